"""The server's own limits, in one place (light to import: the CLI's --help shows them).

Stop strings: at most MAX_STOP_STRINGS per request (OpenAI allows 4, vLLM has no cap; each one
is searched for in every new piece of text).
"""

MAX_STOP_STRINGS = 64
