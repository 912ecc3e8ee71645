"""`hybrid-engine serve`: the OpenAI-compatible HTTP server (hybrid_engine/serve/)."""

from __future__ import annotations

import signal
import sys
import threading

from . import CLIError, add_engine_arguments, build_llm
from ..serve.limits import DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_SHUTDOWN_TIMEOUT

NAME = "serve"
HELP = "serve the model over an OpenAI-compatible HTTP API"
DESCRIPTION = """\
Serve the model over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions (both
streaming or not), /v1/models, /tokenize, /detokenize, /metrics (Prometheus) and /health (503
while the model loads, then 200). Binds to 127.0.0.1 unless --host says otherwise.

Up to --max-num-seqs requests run at once and --max-waiting-requests more wait their turn;
beyond that a request is answered 503 with `Retry-After`. A client may bound a request's time
with the header `X-Request-Timeout: SECONDS` (then 408). SIGTERM or Ctrl-C stops admitting
(503), lets the requests in flight finish for up to --shutdown-timeout seconds, aborts the rest
(a stream ends with an error event and [DONE]) and exits (0 after SIGTERM, 130 after Ctrl-C);
a second signal stops the wait at once.

  hybrid-engine serve --port 8000
  hybrid-engine serve --model /path/to/hf_folder --speculative-tokens 2 --api-key secret

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
  print(client.completions.create(model="default", prompt="def main():", max_tokens=32).choices[0].text)
"""

DEFAULT_MODEL_NAME = "default"


def add_arguments(parser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="MTP speculative decoding with K draft tokens (default: off)")
    parser.add_argument("--cache-memory-bytes", type=int, default=None, metavar="N",
                        help="one byte budget for KV blocks and GDN state slots (default: sized for "
                             "--max-num-seqs requests)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (all but /health)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help=f"the model name clients send (default: the --model folder, else {DEFAULT_MODEL_NAME!r})")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                   help="requests that may wait for a place in the batch before new ones get 503 "
                        f"(default: {DEFAULT_MAX_WAITING_REQUESTS})")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help="at SIGTERM / Ctrl-C, how long requests in flight may run on before they are "
                        f"aborted (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")


def run(args) -> int:
    from ..serve.app import attach_engine, create_app
    from ..serve.server import bind, make_server

    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.max_waiting_requests < 0:
        raise CLIError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if not args.shutdown_timeout >= 0:
        raise CLIError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    app = create_app(None, model_name=name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests)
    sock = bind(args.host, args.port)   # fails now, before the model loads, if the port is taken
    host, port = sock.getsockname()[:2]
    server = make_server(app, args.log_level, args.shutdown_timeout)
    loaded: dict = {}

    def load() -> None:
        try:
            llm = build_llm(args, args.speculative_tokens)   # ValueError if K > 0 and no MTP head
            loaded["llm"] = llm
            attach_engine(app, llm.loop, llm.get_default_sampling_params())
            print(f"hybrid-engine: serving {name!r} on http://{host}:{port}/v1", file=sys.stderr)
        except Exception as e:   # reported by the main thread once the server has stopped
            loaded["error"] = e
            server.should_exit = True

    print(f"hybrid-engine: loading the model; http://{host}:{port}/health answers 503 until it is ready",
          file=sys.stderr)
    threading.Thread(target=load, name="hybrid-engine-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if "llm" in loaded:
            loaded["llm"].shutdown()
    if "error" in loaded:
        raise loaded["error"]
    if server.signals[:1] == [signal.SIGINT]:
        raise KeyboardInterrupt   # the CLI's Ctrl-C: one line, exit code 130
    return 0
