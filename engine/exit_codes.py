"""The one table of exit codes (invariant 13): whether a restart helps is in the code.

Permanent failures are small codes (a restart repeats them); every failure a restart can cure is
>= 128, as Kubeflow's TFJob `restartPolicy: ExitCode` and Kubernetes `podFailurePolicy` rules
expect, and avoids the codes a shell gives to signals people see (128, 130 SIGINT, 137 SIGKILL,
139 SIGSEGV, 143 SIGTERM), so a code says which of the engine's own causes it was. A process
killed by a signal exits 128 + the signal's number; cluster managers treat those as retryable too.

docs/failures.md's table is tested against CODES (tests/test_exit_codes.py), and so are the
manifests in deploy/.
"""

from __future__ import annotations

import dataclasses
import textwrap


@dataclasses.dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    meaning: str
    retryable: bool


DONE = ExitCode(0, "done", "finished (also when --model_dir already held the last step)", False)
BUG = ExitCode(
    1,
    "bug",
    "an unexpected exception (traceback), absl's flag errors, or host-side work after the "
    "steps failed (summaries, --best_metric, export; the checkpoint before it is kept)",
    False,
)
BAD_INPUT = ExitCode(
    2,
    "bad_input",
    "bad flag, config, data, Task or checkpoint; a refused flag combination; a Task method that "
    "fails while traced (its whole traceback in <model_dir>/errors/); one line `error: ...`",
    False,
)
STORAGE_FAILED = ExitCode(
    3,
    "storage_failed",
    "a write into --model_dir failed (disk full, read-only, no permission): a checkpoint save, the event "
    "files, the run record or the lock; the partial checkpoint is removed, the previous one is intact; "
    "free space or make the directory writable, then rerun to resume",
    False,
)
NON_FINITE = ExitCode(
    4,
    "non_finite",
    "a non-finite loss or gradient (or a loss spike) stopped the run "
    "(--on_nonfinite=stop, or rollbacks used up); the last good checkpoint is kept",
    False,
)
PREEMPTED = ExitCode(
    138,
    "preempted",
    "SIGTERM or SIGINT (on any worker): every worker saved a checkpoint of the same step; rerun to resume",
    True,
)
STOPPED_AT_STARTUP = ExitCode(
    154,
    "stopped_at_startup",
    "SIGTERM or SIGINT during start-up, before training had state to save: nothing was written or lost; rerun to start",
    True,
)
PEER_LOST = ExitCode(150, "peer_lost", "a worker of the cluster died or became unreachable while training", True)
STALLED = ExitCode(
    151,
    "stalled",
    "no step completed for --stall_timeout seconds (a hung input pipeline, a "
    "frozen worker); every thread's stack is in <model_dir>/stalls/",
    True,
)
COLLECTIVE_FAILED = ExitCode(
    152, "collective_failed", "a collective operation failed or timed out (--collective_timeout)", True
)
CLUSTER_NOT_FORMED = ExitCode(
    153,
    "cluster_not_formed",
    "not every worker of TF_CONFIG answered this run's handshake within --collective_timeout at "
    "start-up (missing, or another program holds its port: the line names the address)",
    True,
)

CODES = (
    DONE,
    BUG,
    BAD_INPUT,
    STORAGE_FAILED,
    NON_FINITE,
    PREEMPTED,
    PEER_LOST,
    STALLED,
    COLLECTIVE_FAILED,
    CLUSTER_NOT_FORMED,
    STOPPED_AT_STARTUP,
)
RETRYABLE = tuple(c.code for c in CODES if c.retryable)
PERMANENT = tuple(c.code for c in CODES if not c.retryable and c.code)
SIGNAL_CODES = (128, 130, 137, 139, 143)  # never one of ours


def retryable(code: int) -> bool:
    """Whether a restart may cure a process that ended with `code` (ours, or killed by a signal)."""
    return code in RETRYABLE or (code >= 128 and code not in PERMANENT) or code < 0


def describe(code: int) -> str:
    """One phrase for a code: its name and whether a restart helps."""
    known = {c.code: c for c in CODES}
    if code in known:
        c = known[code]
        return f"{c.name}, {'a restart may help' if c.retryable else 'a restart will not help'}"
    if code < 0 or code > 128:
        return "killed by a signal, a restart may help"
    return "a restart will not help"


def markdown_table() -> str:
    """The docs' table (docs/failures.md holds it; tests/test_exit_codes.py compares)."""
    rows = ["| code | name | meaning | restart helps |", "|---|---|---|---|"]
    rows += [f"| {c.code} | `{c.name}` | {c.meaning} | {'yes' if c.retryable else 'no'} |" for c in CODES]
    return "\n".join(rows)


def usage() -> str:
    """The exit-code lines of `run.py --help` (run.py's docstring ends with them)."""
    lines = ["Exit codes (the last line on stderr says why; the table: docs/failures.md#exit-codes):"]
    for c in CODES:
        text = f"{c.name}{' (retryable)' if c.retryable else ''}: {c.meaning}"
        lines += textwrap.wrap(text, 100, initial_indent=f"  {c.code:<3}  ", subsequent_indent=" " * 7)
    lines.append("  a process killed by a signal exits 128 + its number (retryable)")
    return "\n".join(lines)
