"""Generated documentation pages stay in step with the code they are generated from."""

from __future__ import annotations

from pathlib import Path

from tangramd.statedoc import edge_tables, render_state_machines

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_states_page_is_up_to_date() -> None:
    """docs/states.md contains the life-cycle tables exactly as statedoc renders them."""
    assert render_state_machines().strip() in (DOCS / "states.md").read_text()


def test_every_edge_table_is_rendered() -> None:
    """Every ``*_EDGES`` table of the state books appears with all its edges."""
    tables = edge_tables()
    assert {"ACTION_EDGES", "ENV_EDGES", "LEASE_EDGES"} <= set(tables)
    text = render_state_machines()
    for name, edges in tables.items():
        assert f"(`{name}`)" in text
        for (src, dst), why in edges.items():
            cause = why.replace("|", "\\|")  # as a Markdown table cell
            assert f"| `{src}` | `{dst}` | {cause} |" in text
