"""Progress over input rows: a tqdm bar on a terminal, a log line every N seconds otherwise."""
from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm.auto import tqdm


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Rows done (of `total` when known), output tokens/s, prefix-cache hit rate and ETA."""

    def __init__(self, total: int | None, initial: int, enabled: bool = True,
                 stream: TextIO | None = None, interval: float = 30.0):
        self.stream = stream or sys.stderr
        self.total = total
        self.done = initial
        self.initial = initial
        self.interval = interval
        self.enabled = enabled
        self.started = time.monotonic()
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._last_log = self.started
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = None
        if enabled and is_tty:
            self.bar = tqdm(total=total, initial=initial, unit="row", file=self.stream,
                            dynamic_ncols=True, smoothing=0.05)

    def update(self, rows: int, output_tokens: int, prompt_tokens: int, cached_tokens: int) -> None:
        self.done += rows
        self.output_tokens += output_tokens
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        if not self.enabled:
            return
        if self.bar is not None:
            if rows:
                self.bar.set_postfix_str(f"out {self.tokens_per_s():.0f} tok/s, "
                                         f"cache hit {self.hit_rate():.0%}", refresh=False)
                self.bar.update(rows)
            return
        now = time.monotonic()
        if now - self._last_log >= self.interval:
            self._last_log = now
            print(self.line(), file=self.stream, flush=True)

    def tokens_per_s(self) -> float:
        return self.output_tokens / max(time.monotonic() - self.started, 1e-9)

    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = (self.done - self.initial) / elapsed
        of = f"/{self.total} ({self.done / self.total:.1%})" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f", eta {_duration((self.total - self.done) / rate)}"
        return (f"batchinfer: {self.done}{of} rows, {rate:.1f} rows/s, "
                f"{self.tokens_per_s():.0f} out tok/s, cache hit {self.hit_rate():.1%}, "
                f"elapsed {_duration(elapsed)}{eta}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(self.line(), file=self.stream, flush=True)
