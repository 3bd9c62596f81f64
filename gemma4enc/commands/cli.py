"""The console script: the app with every command registered (app.py, running.py, folder.py, tools.py).

stdout carries data (--json), stderr carries progress and messages. Every command runs
through `Command.invoke`, the one place where an error becomes its exit code (EXIT_CODES,
the README's exit-code table): one line on stderr, and with --json an {"error", "exit_code"} object.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["console", "main"]  # and app, imported on first use (__getattr__)


def _app():
    """The app with every command registered, imported on first use: a plain search (quick.py)
    answers without it."""
    # each registers its commands on the app, in the order --help lists them
    from . import running  # noqa: F401 - encode, plan (demo)

    # isort: split
    from . import folder, tools  # noqa: F401
    from .app import app

    return app


def __getattr__(name: str):
    if name == "app":  # `from gemma4enc.commands.cli import app`, as before
        return _app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Every command maps its errors to EXIT_CODES (see Command); ends in SystemExit, as click does.

    A console script installed before console() was its entry point calls main(): that one gets
    console()'s quick way out too (see _stale_script)."""
    if _stale_script():
        console()
        return
    _run()


def _run() -> None:
    # Before torch loads OpenMP: its threads sleep when they run out of work instead of spinning.
    # On a CPU shared with anything else, a spinning thread takes the core its busy sibling needs,
    # and the tower loses far more than the cores it shares (docs/benchmarks.md). A value already
    # in the environment is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        from .quick import run

        code = run(sys.argv[1:])
        if code is not None:
            sys.exit(code)
        _app()()
    except KeyboardInterrupt:  # one that lands past the command's own handling: still exit 130
        sys.exit(130)


def console() -> None:
    """The console script and `python -m gemma4enc`: main(), then a quick way out of a process that
    imported torch (or faiss: search). Tearing down an interpreter that holds torch (its modules,
    their objects, the libraries' destructors) is slow (docs/benchmarks.md) and does nothing for the
    user: everything a command writes is closed by then. So the exit handlers run, stdout and stderr are flushed, and
    the process ends (os._exit). Anything unusual (a thread still running, a flush that fails, an
    exit code that is not a number) takes Python's own way out. In-process callers use main()."""
    try:
        _run()
    except SystemExit as e:
        code = e.code
        if code is None or isinstance(code, int):
            _quick_exit(code or 0)
        raise


def _stale_script() -> bool:
    """This process is the `gemma4enc` script pip wrote when main() was its entry point (an install
    not redone since): its main module is a file of that name that imported main(). A test or
    library caller's main module is not, and keeps main()'s SystemExit."""
    top = sys.modules.get("__main__")
    name = os.path.basename(getattr(top, "__file__", None) or "")
    return getattr(top, "main", None) is main and name.removesuffix("-script.py") in ("gemma4enc", "gemma4enc.exe")


def _quick_exit(code: int) -> None:
    """End now if nothing is left that Python's shutdown would wait for; else return."""
    # nothing heavy to tear down (--help, a bad flag, a no-op run); faiss's is a tenth of a cached search
    if "torch" not in sys.modules and "faiss" not in sys.modules:
        return
    main_thread = threading.main_thread()
    if any(t is not main_thread and t.is_alive() and not t.daemon for t in threading.enumerate()):
        return  # Python joins these before the exit handlers: let it
    atexit._run_exitfuncs()  # multiprocessing's, logging's, tempfile's, Ray's: as at a normal exit
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return  # Python's exit reports a stream that cannot be written (exit code 120)
    _end_forkserver()
    os._exit(code)


def _end_forkserver() -> None:
    """The decode workers' forkserver, ended now rather than once it notices we are gone: it holds
    our stdout and stderr, so whoever reads them (a pipe, $(...)) would wait on its own teardown.
    Its workers are gone by now (the pool stops them); it holds nothing else."""
    import signal

    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)  # private to multiprocessing: looked up with care
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
