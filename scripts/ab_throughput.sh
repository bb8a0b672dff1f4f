#!/usr/bin/env bash
# A/B of `pagedllm bench throughput` (engine only) between two source trees, alternating runs so
# that both see the same machine: ./scripts/ab_throughput.sh OLD_TREE NEW_TREE [ROUNDS] [extra args...]
# Each tree runs with PYTHONPATH pointing at it (the venv's compiled ops are keyed by source hash).
# Prints one line per run and each trace's per-round new/old ratio of output tok/s.
set -euo pipefail
old=$(realpath "$1"); new=$(realpath "$2"); rounds=${3:-2}; shift $(( $# < 3 ? $# : 3 ))
py=${PY:-$(dirname "$0")/../.venv/bin/python}
out=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
  for trace in sharegpt alpaca; do
    for side in old new; do
      tree=$old; [ "$side" = new ] && tree=$new
      dir="$out/$trace-$round-$side"
      (cd "$tree" && PYTHONPATH="$tree" "$py" -m pagedllm.entrypoints.cli --log-level WARNING bench throughput \
        --workload "$trace" --no-hf --no-hf-cb --no-progress --out "$dir" "$@" > "$dir.log" 2>&1)
      "$py" - "$dir/throughput_$trace.json" "$side" "$round" <<'EOF'
import json, sys
engine = next(s for s in json.load(open(sys.argv[1]))["systems"] if s["system"] == "engine")
print(f"{sys.argv[3]} {sys.argv[2]:>3} {sys.argv[1].split('/')[-1]:<26} {engine['output_tok_s']:8.1f} output tok/s"
      f"  {engine['num_preemptions']:3d} preemptions  peak RSS {engine['peak_rss_mib']:.0f} MiB")
EOF
    done
  done
done
"$py" - "$out" "$rounds" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for trace in ("sharegpt", "alpaca"):
    rate = lambda side, r: next(s for s in json.load(open(f"{out}/{trace}-{r}-{side}/throughput_{trace}.json"))["systems"]
                                if s["system"] == "engine")["output_tok_s"]
    ratios = [rate("new", r) / rate("old", r) for r in range(1, rounds + 1)]
    print(f"{trace}: new/old per round " + ", ".join(f"{x:.3f}" for x in ratios))
EOF
