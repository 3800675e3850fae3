"""Progress reports: a tqdm bar when tqdm is installed, printed lines otherwise."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """Progress over ``total`` units: ``with Progress(...) as tick: ... tick()``.

    With tqdm installed, a bar on stderr whose postfix shows the last ``tick``'s text or
    values; without it, the line ``each`` after every unit and the line ``end`` when the
    block finishes without an error (either may be None), formatted with ``desc``,
    ``n``, ``total`` and the tick's values. Not ``enabled``: the block gets None.

    Parameters
    ----------
    desc : str
        The bar's title.
    total : int
        Units expected.
    enabled : bool, default=True
    each, end : str or None, default=None
        ``str.format`` templates of the printed lines.
    """

    def __init__(self, desc: str, total: int, *, enabled: bool = True,
                 each: str | None = None, end: str | None = None):
        self.desc, self.total, self.enabled = desc, total, enabled
        self.each, self.end = each, end
        self.n, self.bar = 0, None

    def __enter__(self):
        if not self.enabled:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            self.bar = tqdm(total=self.total, desc=self.desc, file=sys.stderr)
        return self.tick

    def tick(self, text: str = "", **values) -> None:
        """One unit done; ``text`` or ``values`` (numbers, shown to 4 digits) describe it."""
        self.n += 1
        if self.bar is not None:
            if values:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()},
                                     refresh=False)
            elif text:
                self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.each is not None:
            self._print(self.each, values)

    def iterate(self, iterable):
        """The items of ``iterable``, one unit each (nothing reported when not enabled)."""
        with self as tick:
            for item in iterable:
                yield item
                if tick is not None:
                    tick()

    def _print(self, template, values) -> None:
        print(template.format(desc=self.desc, n=self.n, total=self.total, **values),
              file=sys.stderr)

    def __exit__(self, exc_type, *exc) -> bool:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.end is not None and exc_type is None:
            self._print(self.end, {})
        return False
