"""Progress bars that leave a plain record: tqdm's text line on a terminal, the same line as a plain output in a notebook.

tqdm's notebook bars are widgets, and a widget needs its kernel: a saved notebook reopened later shows "Error
displaying widget: model not found" in their place. Here a notebook gets tqdm's text line as an ordinary output,
replaced in place as the bar moves (a `display_id`), so what is saved is the bar's last state.
"""

from __future__ import annotations

import io

from tqdm.std import tqdm as TextBar


class NotebookBar(TextBar):
    """tqdm whose line is a notebook output updated in place (at most every `mininterval` seconds, as tqdm)."""

    def __init__(self, *args, **kwargs):
        from IPython.display import display

        self._handle = None if kwargs.get("disable") else display({"text/plain": ""}, raw=True, display_id=True)
        # tqdm still writes a newline to its file on close: not to stderr, which a notebook shows as a red block
        super().__init__(*args, **kwargs | {"file": io.StringIO()})

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Replace the output with the bar's line (tqdm calls this; on close with leave=True: the final line)."""
        if self._handle is not None:
            self._handle.update({"text/plain": msg if msg is not None else str(self)}, raw=True)
        return True


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (an IPython shell with a kernel attached)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def bar(*args, **kwargs) -> TextBar:
    """A progress bar with tqdm's arguments: `NotebookBar` in a Jupyter kernel, tqdm's text bar elsewhere."""
    return (NotebookBar if in_notebook() else TextBar)(*args, **kwargs)


__all__ = ["NotebookBar", "bar", "in_notebook"]
