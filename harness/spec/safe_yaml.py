"""YAML for untrusted files: safe tags only, no duplicate keys, bounded size and alias expansion."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a spec is a few kB
MAX_NODES = 100_000  # YAML nodes after alias expansion (a "billion laughs" document has ~10**9)


class YAMLInputError(ValueError):
    """The file is not acceptable YAML input; the message says why (without the file name)."""


class _NoDuplicatesLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (plain YAML keeps the last silently).
    Keys brought in by a merge (``<<: *base``) may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {_short(key)} (first given on line {first + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _expanded_nodes(root: yaml.Node, cap: int) -> int:
    """Nodes of the document once every alias is expanded (stops counting past ``cap``). Shared nodes are
    counted once per use, computed once each: linear in the document, not in its expansion."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise YAMLInputError("an alias refers to a node that contains it (recursive document)")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > cap:
                break
        active.discard(key)
        memo[key] = total
        return total

    return size(root)


def read_text(path: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` (OSError, or YAMLInputError saying why)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise YAMLInputError("not a regular file")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise YAMLInputError(f"larger than {max_bytes:,} bytes; a spec is a few kB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YAMLInputError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def load(text: str, max_nodes: int = MAX_NODES) -> Any:
    """Parse one YAML document: safe tags only, duplicate keys rejected, at most ``max_nodes`` nodes after
    alias expansion. Raises YAMLInputError with a short reason."""
    loader = None
    try:
        loader = _NoDuplicatesLoader(text)  # its reader already rejects control characters
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node, max_nodes) > max_nodes:
            raise YAMLInputError(
                f"expands to more than {max_nodes:,} nodes through its aliases (&anchor / *alias); "
                "write the values out or use fewer aliases"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        text = str(e)
        raise YAMLInputError(f"not valid YAML: {text[:500]}{'...' if len(text) > 500 else ''}") from None
    except RecursionError:
        raise YAMLInputError("nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
