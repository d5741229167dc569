"""Dev tools and probes (not packaged): rejected variants, ablations and measurements."""
import json
import pathlib

from mla import bench   # mla first, as every probe imports it: it may turn Triton's interpreter on


def write_rows(path, rows: list, device, **extra) -> None:
    """A probe's ``rows`` as JSON at ``path``, under the run's provenance (:func:`mla.bench.provenance`,
    with the ceilings measured now on ``device``) and any ``extra`` fields."""
    doc = {"provenance": bench.provenance(bench.ceilings(device)), "rows": rows, **extra}
    pathlib.Path(path).write_text(json.dumps(doc, indent=1) + "\n")
