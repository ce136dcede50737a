"""Run notebook cells in order in one Python process, as a Jupyter kernel would.

The gateway's ``/run_jupyter`` ships this file into a throwaway environment and runs it as
one exec action: ``python3 KERNEL INPUT OUTPUT``. It must stay standard-library only (it
runs under whatever ``python3`` the environment's image has) and is never imported by the
daemon or the gateway.

INPUT (JSON, removed once read): ``{"cells": [str], "cell_timeout": float}``. OUTPUT
(JSON): ``{"status": "Finished", "cells": [...]}`` with, per cell, what SandboxFusion's
Jupyter driver reports: ``stdout`` and ``stderr`` (captured at the file-descriptor level,
so subprocesses count too), ``display`` (one MIME bundle per displayed value: the cell's
last expression when it is not None, ``display(obj)`` calls, matplotlib figures as
``image/png``) and ``error`` (``{"ename", "evalue", "traceback"}``). Cells share one
namespace; a cell that raises records the error and the next cell still runs, as
``execute_interactive`` does. ``cell_timeout`` > 0 interrupts a cell with TimeoutError.
IPython syntax (``%magic``, ``!shell``) is not supported: it is a SyntaxError here.
"""

from __future__ import annotations

import ast
import base64
import json
import linecache
import os
import signal
import sys
import tempfile
import traceback
from typing import Any

MAX_STREAM = 1 << 20  # bytes of stdout (and of stderr) kept per cell


def _bundle(value: Any) -> dict[str, Any]:
    """The MIME bundle Jupyter would show for ``value``."""
    out: dict[str, Any] = {}
    for mime, method in (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_")):
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                text = fn()
            except Exception:
                text = None
            if isinstance(text, str):
                out[mime] = text
    png = getattr(value, "_repr_png_", None)
    if callable(png):
        try:
            data = png()
        except Exception:
            data = None
        if isinstance(data, bytes):
            out["image/png"] = base64.b64encode(data).decode()
    try:
        out["text/plain"] = repr(value)
    except Exception as exc:
        out["text/plain"] = f"<repr failed: {type(exc).__name__}: {exc}>"
    return out


def _figures(display: list[dict[str, Any]]) -> None:
    """Show and close the open matplotlib figures, as the inline backend does after a cell."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    import io

    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        try:
            fig.savefig(buf, format="png", bbox_inches="tight")
        except Exception:
            continue
        w, h = (fig.get_size_inches() * fig.dpi).astype(int)
        display.append(
            {
                "image/png": base64.b64encode(buf.getvalue()).decode(),
                "text/plain": f"<Figure size {w}x{h} with {len(fig.axes)} Axes>",
            }
        )
    plt.close("all")


def _run(source: str, name: str, ns: dict[str, Any], display: list[dict[str, Any]]) -> None:
    tree = ast.parse(source, filename=name)
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr):
        tree.body.pop()
    else:
        last = None
    exec(compile(tree, name, "exec"), ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), name, "eval"), ns)
        if value is not None:
            ns["_"] = value
            display.append(_bundle(value))


def _error(exc: BaseException, name: str) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    # drop the kernel's own frames: the traceback starts in the cell
    skip = next((i for i, f in enumerate(frames) if f.filename == name), len(frames))
    if frames and frames[-1].filename == __file__:  # the cell timer's own handler
        frames.pop()
    tb = traceback.format_list(frames[skip:]) if skip < len(frames) else []
    lines = ["Traceback (most recent call last):\n", *tb] if tb else []
    lines += traceback.format_exception_only(type(exc), exc)
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": lines}


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("cell timed out")


def run_cell(index: int, source: str, ns: dict[str, Any], cell_timeout: float) -> dict[str, Any]:
    name = f"<cell {index}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    result: dict[str, Any] = {"stdout": "", "stderr": "", "display": [], "error": []}
    ns["display"] = lambda *objs: result["display"].extend(_bundle(o) for o in objs)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            if cell_timeout > 0:
                signal.setitimer(signal.ITIMER_REAL, cell_timeout)
            try:
                _run(source, name, ns, result["display"])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too, as IPython
            result["error"].append(_error(exc, name))
        try:
            _figures(result["display"])
        except Exception as exc:
            result["error"].append(_error(exc, name))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        out.seek(0)
        err.seek(0)
        result["stdout"] = out.read(MAX_STREAM).decode("utf-8", errors="replace")
        result["stderr"] = err.read(MAX_STREAM).decode("utf-8", errors="replace")
    return result


def main(argv: list[str]) -> None:
    kernel, inp, outp = argv[0], argv[1], os.path.abspath(argv[2])
    with open(inp, encoding="utf-8") as f:
        config = json.load(f)
    for path in (inp, kernel):  # the cells see only their own files
        os.unlink(path)
    signal.signal(signal.SIGALRM, _on_alarm)
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    cell_timeout = float(config.get("cell_timeout") or 0)
    cells = [run_cell(i, src, ns, cell_timeout) for i, src in enumerate(config["cells"])]
    with open(outp, "w", encoding="utf-8") as f:
        json.dump({"status": "Finished", "cells": cells}, f)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # imports resolve from the environment, as in a notebook
    main(sys.argv)
