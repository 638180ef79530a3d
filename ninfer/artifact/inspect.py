"""Human- and machine-readable summaries of an open artifact (what `ninfer inspect` prints)."""

from __future__ import annotations

from ninfer.artifact.formats import FORMATS
from ninfer.artifact.reader import Artifact, ObjectEntry


def describe(artifact: Artifact, *, objects: bool = False) -> str:
    """Header, per-format counts and byte totals, resources, and optionally one line per object."""
    summary = describe_json(artifact)
    tensors = [entry for entry in artifact.objects if entry.kind == "tensor"]
    resources = summary["resources"]
    lines = [
        f"model_id        {artifact.model_id}",
        f"file            {artifact.path} ({artifact.file_size:,} bytes)",
        f"directory       {artifact.json_bytes:,} bytes of JSON; payload at offset {artifact.payload_offset:,}",
        f"objects         {len(artifact.objects):,} ({len(tensors):,} tensors, {len(resources):,} resources)",
        "",
        f"{'format':<12} {'tensors':>8} {'bytes':>18}",
    ]
    for fmt, totals in summary["formats"].items():
        lines.append(f"{fmt:<12} {totals['count']:>8,} {totals['bytes']:>18,}")
    lines.append(f"{'all':<12} {len(tensors):>8,} {sum(entry.nbytes for entry in tensors):>18,}")
    if resources:
        lines += ["", "resources"]
        lines += [f"  {resource['name']}  {resource['bytes']:,} bytes" for resource in resources]
    if objects:
        lines += ["", f"{'#':>5} {'offset':>16} {'bytes':>16}  {'format/encoding':<18} {'shape':<18} name"]
        lines += [_object_line(index, entry) for index, entry in enumerate(artifact.objects)]
    return "\n".join(lines)


def describe_json(artifact: Artifact) -> dict:
    """The same summary as plain JSON-serialisable data, with every directory entry."""
    formats = {}
    for fmt in FORMATS:  # registry order, only the formats present
        sizes = [entry.nbytes for entry in artifact.objects if entry.format == fmt]
        if sizes:
            formats[fmt] = {"count": len(sizes), "bytes": sum(sizes)}
    return {
        "path": artifact.path,
        "model_id": artifact.model_id,
        "file_bytes": artifact.file_size,
        "json_bytes": artifact.json_bytes,
        "payload_offset": artifact.payload_offset,
        "formats": formats,
        "resources": [
            {"name": entry.name, "bytes": entry.nbytes} for entry in artifact.objects if entry.kind == "resource"
        ],
        "objects": [entry.to_json() for entry in artifact.objects],
    }


def _object_line(index: int, entry: ObjectEntry) -> str:
    kind = entry.format if entry.kind == "tensor" else entry.layout
    shape = "[" + ",".join(map(str, entry.shape)) + "]" if entry.kind == "tensor" else "-"
    return f"{index:>5} {entry.offset:>16,} {entry.nbytes:>16,}  {kind:<18} {shape:<18} {entry.name}"
