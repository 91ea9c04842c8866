#!/usr/bin/env bash
# Paper-scale Search-R1 on one 8-GPU node (see README.md section 4). Extra arguments are Hydra overrides.
#   RETRIEVER_CORPUS  wiki-18 corpus JSONL for a local server (default: use SEARCH_URL's server as it is)
#   SEARCH_URL        Search-R1-compatible /retrieve endpoint (default http://127.0.0.1:8000/retrieve)
set -euo pipefail
SEARCH_URL=${SEARCH_URL:-http://127.0.0.1:8000/retrieve}

if [[ -n "${RETRIEVER_CORPUS:-}" ]]; then
  skyrl-stepwise retriever serve --corpus "$RETRIEVER_CORPUS" --retriever dense --port 8000 &
  retriever=$!
  trap 'kill $retriever' EXIT
  until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 5; done
fi

ray status >/dev/null 2>&1 || ray start --head --disable-usage-stats
RAY_ADDRESS=auto skyrl-stepwise train experiment=search_r1 \
  environment.search.search_url="$SEARCH_URL" "$@"
