"""`skyrl-stepwise retriever serve`: the retrieval server, over the embedded Wikipedia corpus when no --corpus is
given (built on first use). The server itself (retrieval/server.py) needs a corpus path: building the embedded one
is the data room's job, and the retrieval room never imports a room above it."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Serve; without `--corpus`, build (once) and serve the embedded corpus, so the command works with no
    arguments."""
    from skyrl_stepwise.retrieval import server

    argv = list(sys.argv[1:] if argv is None else argv)
    asks_help = any(a in ("-h", "--help") for a in argv)
    if not asks_help and not any(a == "--corpus" or a.startswith("--corpus=") for a in argv):
        from skyrl_stepwise.data.embedded import build_embedded_search_r1

        argv += ["--corpus", str(build_embedded_search_r1().corpus)]
    return server.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
