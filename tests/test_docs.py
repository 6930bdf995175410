"""docs/protocol.md cannot silently drift from the code: every message kind, schema field, error
code (with its retryable flag), WAIT reason and wire dtype used in the sources is documented."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from common.protocol import FRAME_DTYPES, PROTO, SCHEMAS
from common.trajectory import ARRAYS
from common.weights import DTYPE_BYTES

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "protocol.md").read_text()
ERROR_SOURCES = sorted((ROOT / "common").glob("*.py")) + sorted((ROOT / "broker").glob("*.py"))


def kind_sections(doc: str) -> dict[str, str]:
    """``### `KIND` ...`` heading -> the text up to the next heading of level 1-3."""
    sections: dict[str, str] = {}
    for match in re.finditer(r"^### `([A-Z_]+)`.*?$(.*?)(?=^#{1,3} |\Z)", doc, re.M | re.S):
        sections[match.group(1)] = match.group(2)
    return sections


def error_table(doc: str) -> dict[str, bool]:
    """Rows ``| `code` | yes/no | ...`` of the error-code table -> retryable."""
    return {
        code: flag == "yes"
        for code, flag in re.findall(r"^\| `([a-z_]+)` \| (yes|no) \|", doc, re.M)
    }


def raised_codes() -> dict[str, bool]:
    """Every ``ProtocolError("code", ...)`` in common/ and broker/ -> retryable anywhere (from the AST)."""
    codes: dict[str, bool] = {}
    for path in ERROR_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (
                isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ProtocolError"
            ):
                continue
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                raise AssertionError(
                    f"{path.name}:{node.lineno}: ProtocolError code must be a string literal"
                )
            retryable = any(
                k.arg == "retryable" and getattr(k.value, "value", False) is True
                for k in node.keywords
            )
            codes[first.value] = codes.get(first.value, False) or retryable
    return codes


def test_every_message_kind_has_its_own_section():
    missing = sorted(set(SCHEMAS) - set(kind_sections(DOC)))
    assert not missing, f"docs/protocol.md lacks a '### `KIND`' section for {missing}"


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_every_schema_field_is_documented_in_its_kinds_section(kind):
    section = kind_sections(DOC).get(kind, "")
    missing = [name for name in SCHEMAS[kind] if f"`{name}`" not in section]
    assert not missing, f"section `{kind}` of docs/protocol.md does not document fields {missing}"


def test_error_codes_are_found_in_the_sources():
    codes = raised_codes()
    assert {"bad_header", "future_version", "unknown_actor", "version_gone"} <= set(codes)
    assert codes["busy"] and not codes["unknown_permit"]


def test_every_error_code_is_in_the_table_with_its_retryable_flag():
    documented, raised = error_table(DOC), raised_codes()
    missing = sorted(set(raised) - set(documented))
    assert not missing, (
        f"error codes raised in common/ or broker/ but not in docs/protocol.md: {missing}"
    )
    wrong = {code: raised[code] for code in raised if documented[code] != raised[code]}
    assert not wrong, (
        f"retryable flag in docs/protocol.md disagrees with the code (code's value): {wrong}"
    )
    stale = sorted(set(documented) - set(raised))
    assert not stale, f"docs/protocol.md documents error codes no source raises: {stale}"


def test_wait_reasons_and_wire_dtypes_are_documented():
    server = (ROOT / "broker" / "server.py").read_text()
    reasons = set(re.findall(r'_wait\(msg, "([a-z_]+)"', server))
    assert {"no_weights", "stale_weights", "queue_full", "capacity"} <= reasons
    names = (
        [f"`{r}`" for r in reasons]
        + [f'`"{d}"`' for d in FRAME_DTYPES]
        + [f"`{d}`" for d in DTYPE_BYTES]
    )
    names += [f"`{a}`" for a in ARRAYS] + [f"`{d.str}`" for d in ARRAYS.values()]
    missing = [n for n in names if n not in DOC]
    assert not missing, f"docs/protocol.md does not mention {missing}"


def test_the_document_states_the_protocol_version_the_code_speaks_and_how_each_changed():
    title = re.match(r"# asyncppo wire protocol, version (\d+)\n", DOC)
    assert title and int(title.group(1)) == PROTO
    changelog = DOC[DOC.index("## 11. Changelog") :]
    entries = [int(v) for v in re.findall(r"^\*\*Version (\d+)\*\*", changelog, re.M)]
    assert entries == list(range(PROTO, 0, -1)), entries


def test_rejected_invalid_leaves_out_exactly_what_the_broker_leaves_out():
    from broker.server import NOT_INVALID

    sentence = re.search(r"`rejected_invalid`: all rejections except(.*?);\n", DOC, re.S)
    assert sentence, "the STATS_REPLY list no longer says what rejected_invalid leaves out"
    assert set(re.findall(r"`([a-z_]+)`", sentence.group(1))) == NOT_INVALID
