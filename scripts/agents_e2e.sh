#!/usr/bin/env bash
# The real coding agents against `pagedllm serve`: OpenAI's Codex CLI (Responses API, a custom provider with
# wire_api "responses") and Claude Code (Messages API, ANTHROPIC_BASE_URL), each once, non-interactively, on a
# short task that needs a tool call, in a throwaway folder. Both reach only 127.0.0.1, through a recording
# proxy (agents_e2e_proxy.py) that keeps every HTTP exchange.
#
#   scripts/agents_e2e.sh [OUT_DIR]
#
# Environment: MODEL (default: the embedded SmolLM2-135M-Instruct), SERVE_ARGS (more `pagedllm serve` flags),
# AGENTS_DIR (where `npm install` puts the CLIs; default /tmp/pagedllm-agents, installed there if missing),
# TASK (the prompt both agents get), PYTHON (default python), PORT (default 18470; the proxy listens on PORT+1), AGENTS (default "codex claude").
#
# Exit status: 0 when both agents finished without a protocol error (whether the model managed the task or
# not is reported, not judged: a 135M model often does not); 1 with the error otherwise. OUT_DIR keeps
# server.log, http.jsonl (the exchanges), codex.jsonl / claude.jsonl (each CLI's event stream) and summary.txt.
set -euo pipefail

OUT=${1:-$(mktemp -d /tmp/pagedllm-agents-e2e-XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python}
AGENTS_DIR=${AGENTS_DIR:-/tmp/pagedllm-agents}
PORT=${PORT:-18470}
PROXY_PORT=$((PORT + 1))
AGENTS=${AGENTS:-codex claude}
NAME=pagedllm-agent
KEY=e2e-key
HERE=$(cd "$(dirname "$0")" && pwd)
TASK=${TASK:-'List the files in this folder: run the shell command `ls` with your tool, then name the files.'}

if [ ! -x "$AGENTS_DIR/node_modules/.bin/codex" ] || [ ! -x "$AGENTS_DIR/node_modules/.bin/claude" ]; then
    npm install --silent --prefix "$AGENTS_DIR" @openai/codex @anthropic-ai/claude-code
fi
BIN="$AGENTS_DIR/node_modules/.bin"
echo "codex: $("$BIN/codex" --version 2>/dev/null | tail -1); claude: $("$BIN/claude" --version)" | tee "$OUT/summary.txt"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# shellcheck disable=SC2086
"$PYTHON" -m pagedllm.entrypoints.cli serve ${MODEL:-} --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME" \
    --enable-auto-tool-choice --tool-call-parser hermes --api-key "$KEY" ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
pids+=($!)
"$PYTHON" "$HERE/agents_e2e_proxy.py" "$PROXY_PORT" "http://127.0.0.1:$PORT" "$OUT/http.jsonl" 2>"$OUT/proxy.log" &
pids+=($!)
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 "${pids[0]}" 2>/dev/null || { echo "the server exited; see $OUT/server.log" >&2; tail -20 "$OUT/server.log" >&2; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "the server did not start in 600 s" >&2; exit 1; }

WORK="$OUT/work"
mkdir -p "$WORK" && printf 'hello\n' > "$WORK/notes.txt" && printf 'print(1)\n' > "$WORK/main.py"
HOME_DIR="$OUT/home"
mkdir -p "$HOME_DIR"
# Nothing but the local server: no update checks, telemetry or error reports; a proxy that exists nowhere
# catches anything else that tries the network.
export NO_PROXY=127.0.0.1,localhost HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9

run_codex() {
    local codex_home="$HOME_DIR/codex"
    mkdir -p "$codex_home"
    # A 135M model needs the call written out once to copy it (the hermes format the server parses).
    printf '%s\n' 'You are a coding agent in a terminal. To run a shell command, call the exec_command tool. For example, to list files, reply exactly:' \
        '<tool_call>' '{"name": "exec_command", "arguments": {"cmd": "ls"}}' '</tool_call>' \
        'When the output comes back, answer the user in one sentence.' > "$codex_home/instructions.md"
    # The default tool set and instructions fill ~10K tokens (past SmolLM2's 8K context) and include tools
    # the server does not serve (web_search, namespaced multi-agent tools): keep the shell tools only.
    cat > "$codex_home/config.toml" <<TOML
model = "$NAME"
model_provider = "pagedllm"
model_instructions_file = "$codex_home/instructions.md"
web_search = "disabled"
include_apps_instructions = false
check_for_update_on_startup = false

[model_providers.pagedllm]
name = "pagedllm"
base_url = "http://127.0.0.1:$PROXY_PORT/v1"
env_key = "PAGEDLLM_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[agents]
enabled = false

[features]
goals = false
apps = false
plugins = false
skill_search = false
tool_suggest = false
view_image = false
image_generation = false
browser_use = false
computer_use = false
sleep_tool = false
TOML
    (cd "$WORK" && HOME="$HOME_DIR" CODEX_HOME="$codex_home" PAGEDLLM_API_KEY="$KEY" timeout 900 \
        "$BIN/codex" exec --json --skip-git-repo-check --sandbox read-only "$TASK" \
        > "$OUT/codex.jsonl" 2> "$OUT/codex.stderr" < /dev/null)
}

CLAUDE_SYSTEM='You are a coding agent. To run a shell command, call the Bash tool. For example, to list files, reply exactly:
<tool_call>
{"name": "Bash", "arguments": {"command": "ls"}}
</tool_call>
When the output comes back, answer the user in one sentence.'

run_claude() {
    (cd "$WORK" && HOME="$HOME_DIR" ANTHROPIC_BASE_URL="http://127.0.0.1:$PROXY_PORT" ANTHROPIC_API_KEY="$KEY" \
        ANTHROPIC_MODEL="$NAME" ANTHROPIC_DEFAULT_OPUS_MODEL="$NAME" ANTHROPIC_DEFAULT_SONNET_MODEL="$NAME" \
        ANTHROPIC_DEFAULT_HAIKU_MODEL="$NAME" ANTHROPIC_SMALL_FAST_MODEL="$NAME" \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 \
        DISABLE_ERROR_REPORTING=1 CLAUDE_CODE_MAX_OUTPUT_TOKENS=512 timeout 900 \
        "$BIN/claude" -p "$TASK" --bare --model "$NAME" --tools Bash --allowedTools 'Bash(ls:*)' \
            --system-prompt "$CLAUDE_SYSTEM" \
            --max-turns 3 --output-format stream-json --verbose --no-session-persistence \
            --debug-file "$OUT/claude.debug.log" \
        > "$OUT/claude.jsonl" 2> "$OUT/claude.stderr" < /dev/null)
}

status=0
for agent in $AGENTS; do
    rc=0
    "run_$agent" || rc=$?
    echo "$agent: exit status $rc" | tee -a "$OUT/summary.txt"
done

"$PYTHON" - "$OUT" "$AGENTS" <<'PY' | tee -a "$OUT/summary.txt" || status=1
"""Judge the run from the recorded exchanges and the CLIs' event streams: protocol errors fail it."""
import json, pathlib, sys

out, agents = pathlib.Path(sys.argv[1]), sys.argv[2].split()
errors = []
exchanges = [json.loads(l) for l in (out / "http.jsonl").read_text().splitlines()] \
    if (out / "http.jsonl").exists() else []
for x in exchanges:
    print(f"HTTP {x['method']} {x['path']} -> {x.get('status')} ({x['seconds']} s)")
    if x["path"].startswith("/v1/") and (x.get("status") or 599) >= 400 or "error" in x:
        errors.append(f"{x['method']} {x['path']} -> {x.get('status')}: {x.get('error') or x['response'][:600]}")
    for line in x["response"].splitlines():
        try:
            event = json.loads(line[6:]) if line.startswith("data: {") else {}
        except ValueError:
            event = {}
        if event.get("type") in ("error", "response.failed"):
            errors.append(f"{x['path']}: error event in the stream: {line[:600]}")


def events(name):
    path = out / name
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


if "codex" in agents:
    rows = events("codex.jsonl")
    calls = [r["item"] for r in rows if r.get("type") == "item.completed"
             and r.get("item", {}).get("type") in ("command_execution", "function_call", "mcp_tool_call")]
    texts = [r["item"].get("text", "") for r in rows if r.get("type") == "item.completed"
             and r.get("item", {}).get("type") == "agent_message"]
    for call in calls:
        print(f"codex tool call: {json.dumps(call)[:400]}")
    print(f"codex answer: {texts[-1][:400] if texts else '(none)'}")
    for r in rows:
        if r.get("type") in ("error", "turn.failed"):
            text = json.dumps(r)
            # the server's well-formed response.incomplete (the output reached the context's end, or
            # max_output_tokens): the model's outcome, which Codex reports as a failed turn
            if "Incomplete response returned" in text:
                print(f"codex: the answer was cut short (not a protocol error): {text[:300]}")
            else:
                errors.append(f"codex: {text[:600]}")
    if not any(x["path"].startswith("/v1/responses") for x in exchanges):
        errors.append("codex sent no request to /v1/responses (see codex.stderr)")
if "claude" in agents:
    rows = events("claude.jsonl")
    for r in rows:
        if r.get("type") == "assistant":
            for block in r["message"].get("content", []):
                if block.get("type") == "tool_use":
                    print(f"claude tool call: {json.dumps(block)[:400]}")
        if r.get("type") == "user":
            for block in (r["message"].get("content") or []):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    print(f"claude tool result: {json.dumps(block.get('content'))[:300]}")
    result = next((r for r in rows if r.get("type") == "result"), None)
    print(f"claude result: {json.dumps(result)[:600] if result else '(none)'}")
    if result is None or result.get("api_error_status"):
        errors.append(f"claude: {json.dumps(result)[:600] if result else 'no result (see claude.stderr)'}")
    if not any(x["path"].startswith("/v1/messages") for x in exchanges):
        errors.append("claude sent no request to /v1/messages (see claude.stderr)")
for e in errors:
    print(f"PROTOCOL ERROR: {e}")
print(f"{len(errors)} protocol errors; transcripts in {out}")
sys.exit(1 if errors else 0)
PY
exit $status
