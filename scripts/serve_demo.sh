#!/usr/bin/env bash
# Start the server (serve run CONFIG), wait until it is healthy, ask it for one completion
# over the OpenAI API, print the answer, stop the server. Used by the README's first command.
#   usage: bash scripts/serve_demo.sh [serve_configs/local.yaml] [PROMPT]
set -euo pipefail
config="${1:-serve_configs/local.yaml}"
prompt="${2:-The capital of France is}"
url="http://127.0.0.1:8000"
# the README's venv, else a `serve` on PATH, else Ray's CLI module (e.g. Ray installed with
# pip --target, which leaves no script on PATH)
if [ -x .venv/bin/serve ]; then serve_cmd=(.venv/bin/serve)
elif command -v serve >/dev/null; then serve_cmd=(serve)
else serve_cmd=(python3 -m ray.serve.scripts); fi
if curl -sf "$url/health" >/dev/null 2>&1; then
    echo "something already answers on $url; stop it first" >&2
    exit 1
fi
# own process group, so that one signal reaches serve and the Ray processes it starts
# (SIGTERM: a background job of a non-interactive shell ignores SIGINT)
setsid "${serve_cmd[@]}" run "$config" > serve.log 2>&1 &
server=$!
stop() { kill -TERM -- "-$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq 300); do
    curl -sf "$url/health" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { echo "serve run exited; see serve.log" >&2; exit 1; }
    sleep 2
done
# the name the server answers to (the config's served_model_name, e.g. tp2.yaml's 1.5B model)
model=$(curl -sf "$url/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"$prompt\", \"max_tokens\": 16, \"temperature\": 0}"
echo
