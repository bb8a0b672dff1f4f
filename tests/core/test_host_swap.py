"""The swap space's host block ids (core/host_swap.py), with exact ids."""

from pagedllm.core.host_swap import NULL_ENTRY, HostSwapSpace


def test_host_blocks_are_taken_lowest_first_and_come_back_on_release():
    host = HostSwapSpace(4)
    assert host.take("a", 0, 2) == [0, 1]
    assert host.take("b", 1, 1) == [NULL_ENTRY, 2]  # a null device entry copies nothing: no host block
    assert host.num_used_blocks == 3 and host.fits(1) and not host.fits(2)
    assert "a" in host.tables and "c" not in host.tables
    host.release("a")
    assert host.take("c", 0, 3) == [0, 1, 3]
    host.release("nobody")  # holds nothing: nothing to give back
    assert host.problems() == ["host (swap) blocks still held: ['b', 'c']"]
    host.release("b")
    host.release("c")
    assert host.problems() == [] and host.num_used_blocks == 0
