"""``ovshard bundle merge``: join part bundles (``ovshard compile --only-stage K``) into one bundle.

Each node compiles its own stage from its own copy of the checkpoint. The merge checks that the parts
belong together (one format version, checkpoint fingerprint, front end, weight format, plan, runtime
hints, generation ids, config files, tokenizer and chat template), that together they hold every stage
of the plan exactly once, and that every file of every part matches its sha256; then it writes one
complete bundle the way a compile does (a locked partial folder renamed into place), hard-linking the
parts' files where they share the file system with the output and copying them where they do not.

The merged manifest is the one a one-shot compile writes, except for what differs by nature between
runs: the pass log's seconds, and ``source.path``, which is the path stage 0's node read (each node may
keep its copy of the checkpoint elsewhere; the fingerprint says they are the same). Every part carries
the tokenizer and config files (a compile of one stage writes them as a full compile does); the merge
checks they agree and takes stage 0's. A complete bundle is a valid part: it holds every stage.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ovshard.bundle import names, staging
from ovshard.bundle.manifest import Manifest, StageEntry, read_part_manifest, shared_files, verify_files
from ovshard.bundle.plan import PartitionPlan, format_bytes, format_range
from ovshard.bundle.staging import link_or_copy
from ovshard.bundle.weights import WeightFormat
from ovshard.errors import BundleError

log = logging.getLogger(__name__)

_SAME_CHECKPOINT = "compile every part from the same checkpoint"
# What every part must agree on, causes before their effects: (what, its value, what to do if they differ).
_AGREE: tuple[tuple[str, Callable[[Manifest], object], str], ...] = (
    ("source fingerprint", lambda m: m.source.fingerprint,
     f"{_SAME_CHECKPOINT} (copies with the same config.json and weight files)"),
    ("model type", lambda m: m.source.model_type, _SAME_CHECKPOINT),
    ("architecture", lambda m: m.architecture, _SAME_CHECKPOINT),
    ("front end", lambda m: m.source.frontend, "compile every part with the same --frontend"),
    ("weight format", lambda m: m.weights,
     "compile every part with the same --weights, --group-size, --ratio and --all-layers"),
    ("plan", lambda m: m.plan, "compile every part with the same --stages, --layers or --budgets, the same "
     "--context-tokens and the same ovshard version"),
    ("runtime hints", lambda m: m.runtime_hints, "compile every part with the same --max-positions"),
    ("generation ids", lambda m: m.generation, f"{_SAME_CHECKPOINT}, generation_config.json included"),
    ("config files", lambda m: m.extra_files, f"{_SAME_CHECKPOINT}, config.json and generation_config.json included"),
    ("tokenizer", lambda m: m.tokenizer,
     f"{_SAME_CHECKPOINT}, tokenizer files included, with the same openvino-tokenizers version"),
    ("chat template", lambda m: m.chat, f"{_SAME_CHECKPOINT}, tokenizer_config.json and chat template included"),
)


def merge_bundles(parts: Sequence[Path], output: Path) -> Manifest:
    """Check that ``parts`` form one bundle and write it to ``output``; return its manifest."""
    if not parts:
        raise BundleError("no part bundles to merge; give the folders `ovshard compile --only-stage K` wrote")
    read = [(Path(p), read_part_manifest(p)) for p in parts]  # format and version are checked here
    for path, m in read:
        log.info("part %s: %s", path, m.describe_held())
    _check_agreement(read)
    owners = _owners(read)
    for path, m in read:
        try:
            verify_files(path, m)
        except BundleError as e:
            raise BundleError(f"cannot merge part {path}: {e}") from e
    manifest = _merged(read, owners)
    _write(manifest, _sources(manifest, owners), output)
    log.info("merged %d stages from %d parts into %s", manifest.num_stages, len(read), output)
    return manifest


def _check_agreement(read: list[tuple[Path, Manifest]]) -> None:
    """Raise naming the first thing a part disagrees with the first part on, and what to do."""
    (first_path, first), rest = read[0], read[1:]
    for what, value, advice in _AGREE:
        for path, m in rest:
            if value(m) != value(first):
                mine, theirs = _shown(value(first), value(m))
                raise BundleError(f"the parts disagree on the {what}: {first_path} has {mine}, {path} has "
                                  f"{theirs}; {advice}")
    paths = {m.source.path for _, m in read}
    if len(paths) > 1:
        log.info("the parts were compiled from copies of the checkpoint at %s (same fingerprint)", sorted(paths))


def _owners(read: list[tuple[Path, Manifest]]) -> dict[int, tuple[Path, StageEntry, Manifest]]:
    """Stage index -> (its part, its entry, the part's manifest); raise unless each stage is there once."""
    n = read[0][1].num_stages
    found: dict[int, list[tuple[Path, StageEntry, Manifest]]] = {i: [] for i in range(n)}
    for path, m in read:
        for entry in m.stages:
            found[entry.index].append((path, entry, m))
    problems = []
    missing = [str(i) for i, holders in found.items() if not holders]
    if len(missing) == 1:
        problems.append(f"stage {missing[0]} is missing: compile it with `ovshard compile CKPT ... --only-stage "
                        f"{missing[0]}` (the split options of the other parts) and add that part")
    elif missing:
        problems.append(f"stages {', '.join(missing)} are missing: compile each with `ovshard compile CKPT ... "
                        "--only-stage K` (the split options of the other parts) and add those parts")
    for i, holders in found.items():
        if len(holders) > 1:
            problems.append(f"stage {i} is in {len(holders)} parts ({', '.join(str(h[0]) for h in holders)}): "
                            "give each stage once")
    if problems:
        raise BundleError(f"the parts do not hold every stage of the {n}-stage plan exactly once: "
                          + "; ".join(problems))
    return {i: holders[0] for i, holders in found.items()}


def _merged(read: list[tuple[Path, Manifest]], owners: dict[int, tuple[Path, StageEntry, Manifest]]) -> Manifest:
    """The complete manifest: stage 0's part's with every part's entry and pass log, in stage order."""
    _, _, first = owners[0]
    dumps = {m.dumps for _, m in read}
    return dataclasses.replace(
        first,
        stages=tuple(entry for _, entry, _ in owners.values()),
        pass_log=tuple(r for i, (_, _, m) in owners.items() for r in m.pass_log if r.stage == i),
        dumps=dumps.pop() if len(dumps) == 1 else None,  # each node's dumps are on that node
    )


def _sources(manifest: Manifest, owners: dict[int, tuple[Path, StageEntry, Manifest]]) -> dict[str, Path]:
    """Bundle file name -> the part's file it comes from: each stage from its part, the rest from stage 0's."""
    first_path = owners[0][0]
    files = {name: first_path / name for name in shared_files(manifest)}
    for path, entry, _ in owners.values():
        files.update({name: path / name for name in entry.sha256})
    return files


def _write(manifest: Manifest, files: dict[str, Path], output: Path) -> None:
    """Write the bundle atomically: link or copy ``files`` and the manifest into a partial folder, publish it."""
    needed = _bytes_to_copy(files.values(), output)
    workdir = staging.create(output.resolve(), needed)
    try:
        linked = sum(link_or_copy(source, workdir / name) for name, source in files.items())
        staging.write_text(workdir / names.MANIFEST_FILE, manifest.to_json())
        staging.publish(workdir, output)
    except BaseException as e:
        full = staging.disk_full(e, workdir, output, needed)  # judged before the removal frees space
        staging.discard(workdir)
        if full is not None:
            raise full from e
        raise
    log.info("%d files hard-linked, %d copied", linked, len(files) - linked)


def _bytes_to_copy(sources: Iterable[Path], output: Path) -> int:
    """Bytes of the files on another file system than ``output``: those are copied, the rest linked."""
    here = output.resolve()
    while not here.exists():
        here = here.parent
    device = here.stat().st_dev
    return sum(s.stat().st_size for s in sources if s.stat().st_dev != device)


def _shown(a: object, b: object) -> tuple[str, str]:
    """``a`` and ``b`` briefly: of two records or dicts, only the fields or keys that differ."""
    if dataclasses.is_dataclass(a) and type(a) is type(b) and not isinstance(a, PartitionPlan | WeightFormat):
        a, b = (dataclasses.asdict(a), dataclasses.asdict(b))  # type: ignore[arg-type]
    if isinstance(a, dict) and isinstance(b, dict):
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        pairs = [_shown(a.get(k), b.get(k)) for k in differ]
        return (", ".join(f"{k}={x}" for k, (x, _) in zip(differ, pairs, strict=True)),
                ", ".join(f"{k}={y}" for k, (_, y) in zip(differ, pairs, strict=True)))
    mine, theirs = _brief(a), _brief(b)
    if mine == theirs:  # plans with the same stages but other byte counts (another ovshard version)
        return mine, "the same stages with other byte counts"
    return mine, theirs


def _brief(value: object) -> str:
    if isinstance(value, PartitionPlan):
        ranges = " ".join(format_range(s.layers) for s in value.stages)
        budgets = [s.budget_bytes for s in value.stages]
        shown = f"{value.strategy} {ranges} at {value.context_tokens} tokens of context"
        return shown + ("" if None in budgets else f", budgets {', '.join(format_bytes(b or 0) for b in budgets)}")
    if isinstance(value, WeightFormat):
        return value.describe()
    if isinstance(value, str) and len(value) > 24:  # a sha256 or a fingerprint: its start tells them apart
        return value[:19] + "..."
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
