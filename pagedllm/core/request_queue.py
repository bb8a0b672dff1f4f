"""The scheduling policy: the waiting queue, the order of `running`, and who is preempted first.

Both queues speak the subset of `deque` the scheduler uses, so the scheduler reads the same
under either policy:

    append(r)       a new request arrives
    appendleft(r)   a preempted request comes back (FCFS: to the front; priority: to its rank)
    waiting[0]      the next request to admit;  popleft() admits it
    remove(r)       an aborted waiting request leaves

Under 'priority' a request's rank is (priority, arrival_time): lower priority values run sooner,
and among equals the earlier arrival. A preempted request keeps its arrival time, so it returns
ahead of everything of its priority that arrived after it, as it would under FCFS.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagedllm.core.request import Request


def priority_rank(request: Request) -> tuple[int, float]:
    """Lower runs sooner; the worst-ranked running request is the first preempted."""
    return request.priority, request.arrival_time


class WaitingQueue(Protocol):
    def append(self, request: Request) -> None: ...

    def appendleft(self, request: Request) -> None: ...

    def popleft(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __getitem__(self, index: int) -> Request: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(deque):
    """First come, first served: a plain deque; preempted requests go back to the front."""


class PriorityQueue:
    """A heap on (priority, arrival_time, order of entry): ties in both fall back to who was queued first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._entry_order = itertools.count()

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_rank(request), next(self._entry_order), request))

    def appendleft(self, request: Request) -> None:
        """A preempted request's rank already places it: ahead of later arrivals of its priority; among
        equal ranks (a beam group's beams) ahead of those queued before it, as deque.appendleft would."""
        heapq.heappush(self._heap, (*priority_rank(request), -next(self._entry_order), request))

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        index = next(i for i, entry in enumerate(self._heap) if entry[-1] is request)
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __getitem__(self, index: int) -> Request:
        if index == 0:
            return self._heap[0][-1]  # the common case: the next to admit, without sorting
        return sorted(self._heap)[index][-1]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return (entry[-1] for entry in sorted(self._heap))


def take_victims(running: list[Request]) -> list[Request]:
    """Pop the next victims off `running`: its last request, with the rest of its beam group (its beams sit side
    by side); newest first. Under 'fcfs' `running` stays in arrival order, so the last is the newest; under
    'priority' `PriorityPolicy` keeps it sorted by rank, so the last is the worst-ranked."""
    victims = [running.pop()]
    group_id = victims[0].beam_group_id
    while group_id is not None and running and running[-1].beam_group_id == group_id:
        victims.append(running.pop())
    return victims


class PriorityPolicy:
    """The scheduler's collaborator for order under 'priority' (under 'fcfs' there is none: nothing to reorder).

    `running` is sorted by rank, so the victim is the worst-ranked and never one this step already scheduled;
    and a waiting head that could not be admitted for lack of blocks preempts, at the start of the next step,
    the worst-ranked running request it outranks (one per step, while it stays blocked).
    """

    def __init__(self) -> None:
        self._blocked_head: Request | None = None
        """The waiting head the last step could not admit for lack of blocks."""

    @staticmethod
    def order_running(running: list[Request]) -> None:
        """Best rank first, so the last is the worst (the newest among equals: the sort is stable and
        requests join `running` in order)."""
        running.sort(key=priority_rank)

    def note_blocked(self, request: Request) -> None:
        """The waiting head `request` did not fit this step."""
        self._blocked_head = request

    def preempts_for_blocked_head(self, waiting: WaitingQueue, running: list[Request]) -> bool:
        """Call once at the start of a step, with `running` ordered: True if last step's blocked head
        still heads the queue and outranks the worst running request, which then makes room for it.
        Nothing of this step is scheduled yet, so nothing is undone; if the head still does not fit,
        it is noted again and the next victim goes in the next step."""
        head, self._blocked_head = self._blocked_head, None
        if head is None or not waiting or waiting[0] is not head or not running:
            return False
        return priority_rank(running[-1]) > priority_rank(head)


def make_waiting_queue(policy: str) -> WaitingQueue:
    """The waiting queue of a scheduling policy ('fcfs' or 'priority')."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
