"""``python -m tangram.protocol ops|link``: print one of the generated sections of
``docs/protocol.md`` (the op table, or the node <-> coordinator link table) as Markdown.

A module of the package rather than ``python -m tangram.protocol.ops``: the package imports
``ops`` itself, and running an already imported module as ``__main__`` warns.
"""

from __future__ import annotations

import sys

from tangram.protocol import link, ops

TABLES = {"ops": ops.render_markdown, "link": link.render_markdown}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in TABLES:
        print(f"usage: python -m tangram.protocol {'|'.join(TABLES)}", file=sys.stderr)
        return 2
    print(TABLES[argv[0]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
