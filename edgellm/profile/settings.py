"""What a benchmark runs: llama-bench's -p, -n, -r and -t (and the context), one value that a
local run, an --rpc run and llama-bench itself take, so the three measure the same tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from edgellm.engine.runtime import default_threads
from edgellm.errors import UsageError


@dataclass(frozen=True)
class BenchSettings:
    pp: int = 512  # prompt tokens of the prompt-processing test
    tg: int = 128  # tokens of the generation test (0: no such test)
    repetitions: int = 5
    threads: Optional[int] = None  # None: the physical cores
    n_ctx: Optional[int] = None  # None: each test its own token count, as llama-bench

    @property
    def n_threads(self) -> int:
        return int(self.threads or default_threads())

    def check(self) -> None:
        """Refuse what llama.cpp would run into an assert or a context overflow."""
        if self.pp is None or self.pp < 1:
            raise UsageError(f"--pp must be at least 1 (got {self.pp}): the prompt test needs a prompt")
        if self.tg is None or self.tg < 0:
            raise UsageError(f"--tg must be 0 or more (got {self.tg})")
        if self.repetitions < 1:
            raise UsageError(f"-r/--repetitions must be at least 1 (got {self.repetitions})")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be at least 1 (got {self.threads})")
        if self.n_ctx is not None:
            if self.n_ctx < self.pp:
                raise UsageError(f"--ctx {self.n_ctx} is smaller than --pp {self.pp}: the prompt would not fit in the context")
            if self.n_ctx < self.tg:
                raise UsageError(
                    f"--ctx {self.n_ctx} is smaller than --tg {self.tg}: the generated tokens would not fit in the context"
                )

    def tests(self) -> list[dict[str, Any]]:
        """The worker's test list: pp, then tg unless it is 0."""
        out: list[dict[str, Any]] = [{"name": f"pp{self.pp}", "n_prompt": self.pp, "n_gen": 0}]
        if self.tg:
            out.append({"name": f"tg{self.tg}", "n_prompt": 0, "n_gen": self.tg})
        return out

    def request(self, path: Path, files: list[str], *, use_mmap: bool = True, mlock: bool = False) -> dict[str, Any]:
        """The bench worker's request (edgellm.profile._worker) for one model file."""
        return {
            "path": str(path),
            "files": files,
            "threads": self.n_threads,
            "repetitions": self.repetitions,
            "tests": self.tests(),
            "n_ctx": self.n_ctx,
            "use_mmap": use_mmap,
            "mlock": mlock,
        }
