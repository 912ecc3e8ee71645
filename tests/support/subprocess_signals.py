"""For tests that stop a CLI subprocess with Ctrl-C (SIGINT)."""

import signal


def default_sigint() -> None:
    """A Popen preexec_fn: SIGINT back to its default in the child. A shell without job control
    starts background commands (`... &`) with SIGINT ignored; the child inherits that, Python
    then installs no KeyboardInterrupt handler, and the CLI rightly goes on through Ctrl-C, so
    the Ctrl-C tests would fail whenever the suite itself runs in the background."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
