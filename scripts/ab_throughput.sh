#!/usr/bin/env bash
# A/B of `pagedllm bench throughput` (engine only) between source trees, alternating runs so that all
# see the same machine:
#   ./scripts/ab_throughput.sh ROUNDS NAME=TREE[:EXTRA_ARGS] NAME=TREE[:EXTRA_ARGS] ...
# e.g. ./scripts/ab_throughput.sh 2 old=/tmp/old new-f32=.:--gguf-dequantize new=.
# Each tree runs with PYTHONPATH pointing at it (the venv's compiled ops are keyed by source hash).
# Prints one line per run, then each side's output tok/s per round over the first side's.
set -euo pipefail
rounds=$1; shift
py=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}  # not realpath: that leaves the venv
out=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
  for trace in sharegpt alpaca; do
    for side in "$@"; do
      name=${side%%=*}; rest=${side#*=}; tree=$(realpath "${rest%%:*}"); extra=""
      [[ "$rest" == *:* ]] && extra=${rest#*:}
      dir="$out/$trace-$round-$name"
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH="$tree" "$py" -m pagedllm.entrypoints.cli --log-level WARNING bench throughput \
        --workload "$trace" --no-hf --no-hf-cb --no-progress --out "$dir" $extra > "$dir.log" 2>&1)
      "$py" - "$dir/throughput_$trace.json" "$name" "$round" <<'EOF'
import json, sys
engine = next(s for s in json.load(open(sys.argv[1]))["systems"] if s["system"] == "engine")
print(f"round {sys.argv[3]} {sys.argv[2]:>8} {sys.argv[1].split('/')[-1]:<26} {engine['output_tok_s']:8.1f} output tok/s"
      f"  {engine['num_preemptions']:3d} preemptions  peak RSS {engine['peak_rss_mib']:.0f} MiB", flush=True)
EOF
    done
  done
done
"$py" - "$out" "$rounds" "$@" <<'EOF'
import json, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), [s.split("=", 1)[0] for s in sys.argv[3:]]
def rate(trace, name, r):
    systems = json.load(open(f"{out}/{trace}-{r}-{name}/throughput_{trace}.json"))["systems"]
    return next(s for s in systems if s["system"] == "engine")["output_tok_s"]
for trace in ("sharegpt", "alpaca"):
    for name in names[1:]:
        ratios = [rate(trace, name, r) / rate(trace, names[0], r) for r in range(1, rounds + 1)]
        print(f"{trace}: {name}/{names[0]} per round " + ", ".join(f"{x:.3f}" for x in ratios))
EOF
