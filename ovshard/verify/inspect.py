"""``ovshard inspect``: what is in a bundle, what each pass did to each stage."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import openvino as ov

from ovshard.bundle.manifest import Manifest, read_manifest
from ovshard.errors import BundleError
from ovshard.ir.dot import graph_dot, write_svg
from ovshard.ir.printer import graph_text, text_diff

FORMATS = ("text", "dot", "svg", "xml")


@dataclass(frozen=True)
class InspectConfig:
    bundle: Path
    stage: int | None = None
    pass_name: str | None = None
    format: str = "text"
    diff: bool = False
    dump_dir: Path | None = None


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(bundle: Path, m: Manifest) -> str:
    """Stage table, the partition plan's bytes (weights, KV cache per token, memory), pass log with timings, and the
    I/O of each stage."""
    size = {e.index: sum((bundle / f).stat().st_size for f in e.sha256) for e in m.stages}
    stages = [["stage", "layers", "model", "size", "states"]] + [
        [str(e.index), f"[{e.layers[0]}, {e.layers[1]})", e.model_xml, f"{size[e.index] / 2**20:.1f} MiB",
         str(len(e.state_variables))] for e in m.stages]
    passes = list(dict.fromkeys(r.name for r in m.pass_log))  # pipeline order
    log = [["pass"] + [f"stage {e.index}" for e in m.stages]]
    for name in passes:
        cells = {r.stage: f"{'changed' if r.modified else 'no-op'} {r.seconds:.2f}s"
                 for r in m.pass_log if r.name == name}
        log.append([name] + [cells.get(e.index, "-") for e in m.stages])
    io = []
    for e in m.stages:
        io.append(f"stage {e.index}")
        io += [f"  in  {t.name}: {t.element_type}{t.shape}" for t in e.inputs]
        io += [f"  out {t.name}: {t.element_type}{t.shape}" for t in e.outputs]
    weights = m.weights.describe()
    tok = "yes" if m.tokenizer else "no (token ids only)"
    head = (f"bundle {bundle}  ({m.source.model_type}, {m.architecture.num_layers} layers, "
            f"{m.num_stages} stages, {m.plan.strategy} plan{_part_note(m)})\nweights: {weights}\ntokenizer: {tok}\n"
            f"source: {m.source.path} ({m.source.frontend} front end)\nfingerprint: {m.source.fingerprint}")
    plan = f"partition plan ({m.plan.strategy}; memory at {m.plan.context_tokens} tokens of context):\n"
    return "\n\n".join([head + "\n" + kv_line(m), _table(stages), plan + m.plan.format_table(),
                        "pass log (pipeline order per stage):\n" + _table(log), "\n".join(io)])


def kv_line(m: Manifest) -> str:
    """The KV cache's bytes a token and layer as a CPU stage stores them under the bundle's hints
    (bundle/kv_store.py: the plan's count), beside f16's; an MLA model's line says which form its cache holds and
    what the other would hold."""
    d, store = m.architecture, m.kv_store
    keys, values = d.cache_dims
    heads = f"{d.cache_heads} {'head' if d.cache_heads == 1 else 'heads'}"
    line = (f"KV cache: {store.bytes_per_token(d):,} B a token a layer ({heads} x (keys {keys} + values {values}) "
            f"as {store.describe()}; f16 would be {d.kv_elements_per_token * 2:,} B)")
    if not d.mla:
        return line
    other = store.bytes_per_token(replace(d, latent_cache=not d.latent_cache))
    if d.latent_cache:
        return (line + f"; latent attention's latent cache (keys: latent {d.kv_lora_rank} + rotary key "
                f"{d.rope_head_dim}, values: the latent), held expanded it would be {other:,} B")
    return (line + f"; latent attention held expanded: its latent cache (keys: latent {d.kv_lora_rank} + rotary "
            f"key {d.rope_head_dim}, values: the latent) would be {other:,} B")


def _part_note(m: Manifest) -> str:
    """For a part bundle (``compile --only-stage``): which stages it holds, and that it must be merged."""
    return "" if m.complete else f"; a part holding {m.describe_held()}: merge the parts with `ovshard bundle merge`"


def _dump_dir(config: InspectConfig, m: Manifest) -> Path:
    found = config.dump_dir or (Path(m.dumps) if m.dumps else None)
    if found is None or not found.is_dir():
        raise BundleError(f"{config.bundle} was compiled without graph dumps; recompile with "
                          "`--dump-after all --dump-dir DIR` (or pass --dump-dir to inspect)")
    return found


def _file(stem: Path, ext: str) -> Path:
    return stem.with_name(stem.name + ext)


def _dump_stems(folder: Path, pass_name: str) -> tuple[Path, Path]:
    """(graph before the pass, graph after it) as dump stems without extension."""
    after = sorted(p for p in folder.glob(f"[0-9][0-9]_{pass_name}.txt"))
    if not after:
        dumped = {p.stem.split("_", 1)[1] for p in folder.glob("[0-9][0-9]_*.txt")}
        known = sorted(n for n in dumped - {"input"} if "." not in n)  # not <pass>.before / <pass>.failed
        raise BundleError(f"no dump after pass {pass_name!r} in {folder}; dumped passes: "
                          f"{', '.join(known) or 'none (recompile with --dump-after all)'}")
    stem = after[0].with_suffix("")
    before = stem.with_name(stem.name + ".before")
    if not _file(before, ".txt").exists():
        n = int(stem.name[:2])
        earlier = sorted(p for p in folder.glob("[0-9][0-9]_*.txt") if int(p.name[:2]) < n
                         and ".before" not in p.name)
        before = earlier[-1].with_suffix("") if earlier else stem
    return before, stem


def _render(stem: Path, fmt: str) -> str:
    if fmt == "text":
        return _file(stem, ".txt").read_text()
    if fmt == "dot":
        return _file(stem, ".dot").read_text()
    target = _file(stem, "." + fmt)
    if fmt == "svg" and not target.exists() and not write_svg(_file(stem, ".dot").read_text(), target):
        raise BundleError("SVG needs Graphviz `dot` on PATH (apt-get install graphviz); use --format dot")
    if not target.exists():
        raise BundleError(f"{target} was not dumped")
    return str(target)


def stage_graph(bundle: Path, m: Manifest, stage: int, fmt: str) -> str:
    """The final graph of a stage as stored in the bundle."""
    xml = bundle / m.stages[stage].model_xml
    if fmt == "xml":
        return str(xml)
    model = ov.Core().read_model(str(xml))
    if fmt == "text":
        return graph_text(model)
    dot = graph_dot(model)
    if fmt == "dot":
        return dot
    svg = xml.with_suffix(".svg")
    if not write_svg(dot, svg):
        raise BundleError("SVG needs Graphviz `dot` on PATH (apt-get install graphviz); use --format dot")
    return str(svg)


def inspect_bundle(config: InspectConfig) -> str:
    bundle = Path(config.bundle)
    m = read_manifest(bundle)
    if config.format not in FORMATS:
        raise BundleError(f"--format {config.format!r}; expected one of {', '.join(FORMATS)}")
    if config.stage is None:
        if config.pass_name or config.diff:
            raise BundleError("--pass and --diff need --stage N")
        return summary(bundle, m)
    if not 0 <= config.stage < m.num_stages:
        raise BundleError(f"--stage {config.stage}: the bundle has stages 0..{m.num_stages - 1}")
    if config.pass_name is None:
        return stage_graph(bundle, m, config.stage, config.format)
    folder = _dump_dir(config, m) / f"stage{config.stage}"
    before, after = _dump_stems(folder, config.pass_name)
    if config.diff:
        diff = text_diff(_file(before, ".txt").read_text(), _file(after, ".txt").read_text(),
                         before.name, after.name)
        return diff or f"{config.pass_name} did not change stage {config.stage}"
    return _render(after, config.format)
