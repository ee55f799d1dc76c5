"""Re-exported assertions for test modules (conftest is not importable by name), and small shared helpers."""

from conftest import DEFAULT_NAME, WIKITEXT, assert_one_line_error, store_snapshot  # noqa: F401


def tamper_manifest(bundle, field: str, value) -> None:
    """Rewrite one field of an exported bundle's manifest: the model's `name`, or a key of its first file."""
    import json

    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    if field == "name":
        m["models"][0]["name"] = value
    else:
        m["models"][0]["files"][0][field] = value
    path.write_text(json.dumps(m))
