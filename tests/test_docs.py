"""The reference pages and the README say what the code does: every recipe key is documented, every
documented key exists, every link resolves, and the README stays short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys |= _leaf_keys(kind, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def _documented(page: str) -> set[str]:
    """The keys in the first column of the page's tables."""
    return set(re.findall(r"^\| `([a-z0-9_.]+)` \|", page, flags=re.M))


def test_every_recipe_key_is_documented_and_every_documented_key_exists():
    from acre_train.data.settings import Stage1Settings, Stage2Settings
    from acre_train.train.recipe_schema import Recipe

    schema = _leaf_keys(Recipe)
    schema |= {f"data.prepare.{k}" for k in (*Stage1Settings.model_fields, *Stage2Settings.model_fields) if k != "output"}
    documented = _documented((ROOT / "docs" / "recipes.md").read_text(encoding="utf-8"))
    assert not schema - documented, f"recipe keys missing from docs/recipes.md: {sorted(schema - documented)}"
    assert not documented - schema, f"docs/recipes.md names keys the schema lacks: {sorted(documented - schema)}"


def test_the_readme_fits_two_screens_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "real-base" / "record.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"


def test_the_real_base_report_table_is_what_its_predictions_give():
    """docs/real-base.md's summary table is written by studies/real/tables.py from the committed
    predictions it links: an edit by hand, or data without the table, fails here."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "studies.real.tables", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
