"""The server's own limits, in one place (light to import: the CLI's --help shows them).

Backpressure: up to --max-num-seqs requests run at once and DEFAULT_MAX_WAITING_REQUESTS more
(--max-waiting-requests) may wait for a place; a request beyond that is answered 503 with
`Retry-After: RETRY_AFTER_SECONDS`. Shutdown: requests in flight get DEFAULT_SHUTDOWN_TIMEOUT
seconds (--shutdown-timeout) to finish. (The cap on stop strings is the engine's own,
sampling_params.MAX_STOP_STRINGS.)
"""

DEFAULT_MAX_WAITING_REQUESTS = 256
RETRY_AFTER_SECONDS = 1
DEFAULT_SHUTDOWN_TIMEOUT = 20.0   # within Kubernetes' default 30 s grace period
