"""Read nccl-tests output (``all_reduce_perf`` and friends) into collective samples.

A file holds one or more tests as the binaries print them: a ``# Collective test
starting: all_reduce_perf`` line (nccl-tests 2.13 and later; older outputs are named by
their file, ``all_reduce_perf.txt``), the ``# Using devices`` list (one ``Rank`` line
per GPU, with its host), the column header and one line per message size. The
out-of-place time is taken. Lines prefixed by a launcher (``[1,0]<stdout>:`` from
``mpirun --tag-output``, ``0:`` from ``srun --label``) are read without the prefix.
``NCCL_ALGO set by environment to Ring`` (``NCCL_DEBUG=INFO``) marks a run that forced
rings, which is priced as a ring.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.calibrate.fit import CalibrationError, FitResult
from planner.calibrate.links import LinkSample, Tier, fit_tier, table_error
from planner.cost.communication import Algorithm, Collective
from planner.hardware import HardwareProfile

__all__ = [
    "NcclTable",
    "TableFit",
    "LinkCalibration",
    "parse_nccl_tests",
    "read_nccl_tests",
    "calibrate_links",
]

# The binaries whose collective the cost model prices
TESTS = {
    "all_reduce_perf": Collective.ALL_REDUCE,
    "all_gather_perf": Collective.ALL_GATHER,
    "reduce_scatter_perf": Collective.REDUCE_SCATTER,
    "alltoall_perf": Collective.ALL_TO_ALL,
    "sendrecv_perf": Collective.SEND_RECV,
    "broadcast_perf": Collective.BROADCAST,
}
_PREFIX = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:|\d+:\s)")
_STARTING = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_RANK = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+"
    r"\[[^\]]*\]\s*(.*?)\s*$"
)
_ALGO = re.compile(r"NCCL_ALGO set by environment to (\w+)", re.IGNORECASE)


@dataclass(frozen=True)
class NcclTable:
    """One test's table: ``kind`` over ``ranks`` GPUs on ``nodes`` hosts (as many on each),
    ``rows`` of (bytes, out-of-place seconds)."""

    source: str
    kind: Collective
    ranks: int
    nodes: int
    device: str
    algorithm: Algorithm | None
    rows: tuple[tuple[int, float], ...]

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def samples(self) -> list[LinkSample]:
        return [
            LinkSample(self.kind, self.ranks, self.per_node, size, seconds, self.algorithm)
            for size, seconds in self.rows
        ]

    @property
    def label(self) -> str:
        forced = f", NCCL_ALGO={self.algorithm.value}" if self.algorithm else ""
        return (
            f"{self.source}: {self.kind.value} over {self.ranks} ranks on {self.nodes} "
            f"node{'s' if self.nodes > 1 else ''}{forced}"
        )


def read_nccl_tests(path: Path) -> list[NcclTable]:
    """The tables of one nccl-tests output file (raises :class:`CalibrationError` naming
    the file and what is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        raise CalibrationError(f"--nccl-tests {path}: cannot read it ({error})") from error
    return parse_nccl_tests(text, source=path.name)


def parse_nccl_tests(text: str, source: str) -> list[NcclTable]:
    """The tables in ``text``, the output of one or more nccl-tests runs; ``source`` (a
    file name) names the test where the output does not (nccl-tests before 2.13)."""
    lines = [_PREFIX.sub("", line, count=1).strip() for line in text.splitlines()]
    forced = _forced_algorithm(text, source)
    starts = [i for i, line in enumerate(lines) if _STARTING.match(line)]
    if not starts:
        return [_table(lines, _test_from_name(source), forced, source)]
    blocks = zip(starts, [*starts[1:], len(lines)], strict=True)
    return [
        _table(lines[begin:end], _test_name(lines[begin], source), forced, source)
        for begin, end in blocks
    ]


def _test_name(line: str, source: str) -> str:
    match = _STARTING.match(line)
    assert match is not None  # the caller found the line by this pattern
    return match.group(1).removesuffix(".exe").rsplit("/", 1)[-1]


def _test_from_name(source: str) -> str:
    stem = source.lower()
    found = [name for name in TESTS if name.removesuffix("_perf") in stem]
    if len(found) != 1:
        raise CalibrationError(
            f"--nccl-tests {source}: cannot tell which collective it measured (no '# "
            "Collective test starting' line, as nccl-tests before 2.13 print): name the "
            f"file after the test, e.g. all_reduce_perf.txt (one of {', '.join(TESTS)})"
        )
    return found[0]


def _forced_algorithm(text: str, source: str) -> Algorithm | None:
    names = {m.group(1).lower() for m in _ALGO.finditer(text)}
    if not names:
        return None
    if len(names) > 1 or not names <= {"ring", "tree"}:
        raise CalibrationError(
            f"--nccl-tests {source}: NCCL_ALGO was set to {', '.join(sorted(names))}; the "
            "cost model prices NCCL's own choice, Ring or Tree: re-run with NCCL_ALGO unset "
            "(or Ring)"
        )
    return Algorithm(names.pop())


def _table(lines: list[str], test: str, forced: Algorithm | None, source: str) -> NcclTable:
    if test not in TESTS:
        raise CalibrationError(
            f"--nccl-tests {source}: {test} is not a collective the cost model prices; "
            f"give the output of {', '.join(TESTS)}"
        )
    hosts, device = _devices(lines, source, test)
    per_host = Counter(hosts.values())
    if len(set(per_host.values())) > 1:
        counts = ", ".join(f"{host} {n}" for host, n in sorted(per_host.items()))
        raise CalibrationError(
            f"--nccl-tests {source} ({test}): the hosts ran different numbers of ranks "
            f"({counts}); run as many GPUs on every node"
        )
    rows = _rows(lines, source, test)
    return NcclTable(source, TESTS[test], len(hosts), len(per_host), device, forced, rows)


def _devices(lines: list[str], source: str, test: str) -> tuple[dict[int, str], str]:
    """Host of each rank and the GPU name most ranks printed."""
    hosts: dict[int, str] = {}
    devices: Counter[str] = Counter()
    for line in lines:
        match = _RANK.match(line)
        if match:
            hosts[int(match.group(1))] = match.group(2)
            devices[match.group(3)] += 1
    if len(hosts) < 2:
        raise CalibrationError(
            f"--nccl-tests {source} ({test}): found {len(hosts)} '#  Rank N ... on HOST "
            "device' lines, need one per GPU and two or more GPUs: keep the whole output, "
            "from '# Using devices' on"
        )
    return hosts, devices.most_common(1)[0][0]


def _rows(lines: list[str], source: str, test: str) -> tuple[tuple[int, float], ...]:
    """(bytes, out-of-place seconds) per size, read by the column header."""
    header = next(
        (line.lstrip("#").split() for line in lines
         if line.startswith("#") and "size" in line and "time" in line),
        None,
    )  # fmt: skip
    if header is None:
        raise CalibrationError(
            f"--nccl-tests {source} ({test}): no '#  size  count  type ...  time' header: "
            "keep the whole output of the run"
        )
    time_at = header.index("time")
    wrong_at = header.index("#wrong") if "#wrong" in header else None
    rows: list[tuple[int, float]] = []
    for line in lines:
        fields = line.split()
        if line.startswith("#") or len(fields) <= time_at or not fields[0].isdigit():
            continue
        if wrong_at is not None and fields[wrong_at].isdigit() and int(fields[wrong_at]):
            raise CalibrationError(
                f"--nccl-tests {source} ({test}): {fields[wrong_at]} wrong results at "
                f"{fields[0]} bytes; a run that validates wrong is not a measurement of "
                "a working collective: fix the cluster and re-run"
            )
        size, seconds = int(fields[0]), float(fields[time_at]) * 1e-6
        if size > 0 and seconds > 0:
            rows.append((size, seconds))
    if len(rows) < 2:
        raise CalibrationError(
            f"--nccl-tests {source} ({test}): {len(rows)} timed sizes, need two or more: "
            "run with -b 8 -e 8G -f 2 (sizes 8 B to 8 GB)"
        )
    return tuple(rows)


@dataclass(frozen=True)
class TableFit:
    """A table's mean |relative error| on the profile before and after the fit."""

    table: NcclTable
    before: float
    after: float


@dataclass(frozen=True)
class LinkCalibration:
    """What :func:`calibrate_links` did: each table's error, each fitted field's
    (before, after) by dotted profile path, and each tier's fit."""

    tables: list[TableFit]
    fields: dict[str, tuple[float, float]]
    fits: dict[Tier, FitResult]


def calibrate_links(
    profile: HardwareProfile, tables: Sequence[NcclTable], today: str
) -> tuple[HardwareProfile, LinkCalibration]:
    """``profile`` with its links fitted to ``tables``: single-node tables fit the
    scale-up link, then tables across nodes the network (whose steps inside a node the
    fitted scale-up link prices). Each fitted field's source names the files and
    ``today`` (an ISO date)."""
    fitted = profile
    fields: dict[str, tuple[float, float]] = {}
    fits: dict[Tier, FitResult] = {}
    tiers: tuple[Tier, ...] = ("intra_node", "inter_node")
    for tier in tiers:
        chosen = [t for t in tables if t.samples[0].tier == tier]
        if not chosen:
            continue
        samples = [s for t in chosen for s in t.samples]
        files = ", ".join(sorted({t.source for t in chosen}))
        how = (
            f"fitted {today} to nccl-tests output ({files}; {len(samples)} sizes) by plan "
            "calibrate --nccl-tests"
        )
        fitted, fits[tier], changed = fit_tier(fitted, samples, tier, how)
        fields.update(changed)
    report = [
        TableFit(t, table_error(t.samples, profile), table_error(t.samples, fitted)) for t in tables
    ]
    return HardwareProfile.model_validate(fitted.model_dump()), LinkCalibration(
        report, fields, fits
    )
