"""The $refs of a JSON schema, checked before a grammar engine sees it.

A grammar engine reports a schema whose $refs lead back to themselves without consuming
anything ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}) with a dump
of its own state, or compiles it and then never ends a value. Here the schema is checked in
the client's terms: every local $ref must point at a subschema, and every subschema must be
*grounded*, i.e. describe a value without first describing the very same value again.

A subschema is grounded when its $ref target and all of its allOf branches are, and at least
one branch of each anyOf / oneOf is; a subschema without those keywords is grounded by itself
(an object or array whose properties or items refer back to it makes progress: a tree is
fine). What is left ungrounded after the least fixed point lies on, or leads to, a cycle of
$ref / allOf / anyOf / oneOf steps with no object or array in between; the cycle is named by
the JSON pointers along it.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

from engine.structured_output.backend import GrammarError

# Keywords whose value is one subschema, a map of them, or a list of them (drafts 4 to 2020-12).
_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_ANY = ("anyOf", "oneOf")  # grounded when one branch is


def check_schema_refs(schema: Any) -> None:
    """Raise GrammarError for a local $ref that points nowhere or a $ref cycle that never
    makes progress, naming it by JSON pointers; return for anything else (other errors are
    the grammar engine's to find)."""
    if not isinstance(schema, dict):
        return
    graph = _Graph(schema)
    if graph.opaque:
        return
    grounded = graph.grounded()
    if len(grounded) < len(graph.nodes):
        cycle = graph.cycle(grounded)
        raise GrammarError(
            f"the schema has a $ref cycle: {' → '.join(cycle)} (it leads back to itself "
            "without an object or array in between, so no value can match it)"
        )


def _branches(pointer: str, node: dict[str, Any], key: str) -> list[str]:
    value = node.get(key)
    if not isinstance(value, list):
        return []
    return [f"{pointer}/{key}/{i}" for i, sub in enumerate(value) if isinstance(sub, dict | bool)]


def _where(pointer: str) -> str:
    return "at the root" if pointer == "#" else f"at {pointer}"


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


class _Graph:
    """Every subschema reachable from the root (by pointer), with its same-value steps."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes: dict[str, Any] = {}  # pointer -> subschema (dict or bool), in BFS order
        self.all_of: dict[str, list[str]] = {}  # pointer -> every one must be grounded
        self.any_of: dict[str, list[list[str]]] = {}  # pointer -> one of each group
        # A nested $id changes what "#/..." means below it: such a schema is left to the engine.
        self.opaque = False
        self._explore()

    def _explore(self) -> None:
        queue: deque[str] = deque(["#"])
        self.nodes["#"] = self.root
        while queue:
            pointer = queue.popleft()
            node = self.nodes[pointer]
            if not isinstance(node, dict):
                continue
            if pointer != "#" and "$id" in node:
                self.opaque = True
                return
            conj: list[str] = []
            disj: list[list[str]] = []
            for child in self._children(pointer, node):
                if child[0] not in self.nodes:
                    self.nodes[child[0]] = child[1]
                    queue.append(child[0])
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                target = self._resolve(ref, pointer)
                if target not in self.nodes:
                    self.nodes[target] = self._at(target)
                    queue.append(target)
                conj.append(target)
            conj += _branches(pointer, node, "allOf")
            for key in _ANY:
                if branches := _branches(pointer, node, key):
                    disj.append(branches)
            self.all_of[pointer] = conj
            self.any_of[pointer] = disj

    @staticmethod
    def _children(pointer: str, node: dict[str, Any]):
        for key in _ONE:
            value = node.get(key)
            if isinstance(value, dict | bool):
                yield f"{pointer}/{_escape(key)}", value
        for key in _MAP:
            value = node.get(key)
            if isinstance(value, dict):
                for name, sub in value.items():
                    if isinstance(sub, dict | bool):
                        yield f"{pointer}/{_escape(key)}/{_escape(str(name))}", sub
        for key in _LIST:
            value = node.get(key)
            if isinstance(value, list):
                for i, sub in enumerate(value):
                    if isinstance(sub, dict | bool):
                        yield f"{pointer}/{_escape(key)}/{i}", sub

    def _resolve(self, ref: str, at: str) -> str:
        """The canonical pointer of a local $ref's target; GrammarError when it has none."""
        tokens = [unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/")]
        if ref == "#":
            tokens = []
        value: Any = self.root
        for token in tokens:
            if isinstance(value, dict) and token in value:
                value = value[token]
            elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
                value = value[int(token)]
            else:
                raise GrammarError(f'the $ref "{ref}" {_where(at)} points to nothing in the schema')
        if not isinstance(value, dict | bool):
            raise GrammarError(f'the $ref "{ref}" {_where(at)} does not point to a schema')
        return "#" + "".join("/" + _escape(t) for t in tokens)

    def _at(self, pointer: str) -> Any:
        value: Any = self.root
        for token in pointer[2:].split("/") if pointer != "#" else []:
            token = token.replace("~1", "/").replace("~0", "~")
            value = value[int(token)] if isinstance(value, list) else value[token]
        return value

    def grounded(self) -> set[str]:
        """The least fixed point: a worklist over the reverse steps, linear in the steps."""
        pending: dict[str, int] = {}
        met: dict[str, set[int]] = {}
        waiting: dict[str, list[tuple[str, int]]] = {}  # target -> (node, group or -1)
        ready: deque[str] = deque()
        for pointer in self.nodes:
            conj = self.all_of.get(pointer, [])
            disj = self.any_of.get(pointer, [])
            pending[pointer] = len(conj) + len(disj)
            met[pointer] = set()
            for target in conj:
                waiting.setdefault(target, []).append((pointer, -1))
            for group, targets in enumerate(disj):
                for target in targets:
                    waiting.setdefault(target, []).append((pointer, group))
            if pending[pointer] == 0:
                ready.append(pointer)
        grounded: set[str] = set()
        while ready:
            pointer = ready.popleft()
            if pointer in grounded:
                continue
            grounded.add(pointer)
            for node, group in waiting.get(pointer, ()):
                if group >= 0:
                    if group in met[node]:
                        continue
                    met[node].add(group)
                pending[node] -= 1
                if pending[node] == 0:
                    ready.append(node)
        return grounded

    def cycle(self, grounded: set[str]) -> list[str]:
        """The pointers along one cycle of ungrounded steps (first and last the same)."""
        pointer = next(p for p in self.nodes if p not in grounded)
        path: list[str] = []
        seen: dict[str, int] = {}
        while pointer not in seen:
            seen[pointer] = len(path)
            path.append(pointer)
            pointer = self._ungrounded_step(pointer, grounded)
        return [*path[seen[pointer] :], pointer]

    def _ungrounded_step(self, pointer: str, grounded: set[str]) -> str:
        for target in self.all_of.get(pointer, []):
            if target not in grounded:
                return target
        for targets in self.any_of.get(pointer, []):
            if all(t not in grounded for t in targets):
                return targets[0]
        raise AssertionError(f"{pointer} has no ungrounded step")  # the fixed point says so
