"""No product module calls a torch collective that pickles: what a peer sends is data (JSON or raw numbers).

torch's `*_object` collectives unpickle what the other ranks send, and the ranks meet in an unauthenticated store
that tells each rank where its peers listen (pretrain/distributed/rank_store.py): someone who can write that
store can point a rank's peer connection at themselves and send a pickle. The toolkit's exchanges go through
pretrain/distributed/json_collectives.py instead. An AST scan (any reference: `dist.all_gather_object`, an
import of the name, a `getattr` string), reading the code without importing it.
"""

from __future__ import annotations

import ast

from tests.pretrain.test_house_guards import product_modules, relative

PICKLING = frozenset({"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"})


def pickling_references(source: str) -> list[int]:
    """Line numbers of every reference to a pickling collective in `source`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        named = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                 else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
        imported = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
        if named in PICKLING or PICKLING.intersection(imported):
            lines.append(node.lineno)
    return lines


def test_the_scan_sees_each_way_of_naming_one() -> None:
    """The scan itself: each spelling the call sites used before json_collectives is found, prose is not."""
    source = ("import torch.distributed as dist\nfrom torch.distributed import broadcast_object_list\n"
              "dist.all_gather_object(out, mine)\ngetattr(dist, 'gather_object')\n'''all_gather_object docs'''\n")
    assert pickling_references(source) == [2, 3, 4]


def test_no_product_module_calls_a_pickling_collective() -> None:
    found = {f"{relative(path)}:{line}" for path in product_modules()
             for line in pickling_references(path.read_text(encoding="utf-8"))}
    assert not found, f"torch collectives that unpickle a peer's bytes (use json_collectives): {sorted(found)}"
