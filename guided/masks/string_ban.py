"""Tokens that can never come next inside a JSON string, at a character boundary: a ban that
a lazy row (guided/masks/lazy.py) can carry instead of allowing everything.

A lazy row is sampled without its grammar mask, and a sample outside the grammar costs its
request a step or two. Inside a JSON string most of those samples are tokens no JSON grammar
allows there whatever the schema says: a raw control byte, a bad escape, a stray UTF-8
continuation byte, a quote followed by anything but whitespace and `,` `:` `}` `]`. Banning
them keeps the row exact (every token the grammar allows survives the ban, so the unmasked
argmax that the grammar allows is still the masked one) and leaves far fewer misses.

The scan is over what JSON permits, never over a schema: a token is banned only where its
bytes break JSON's string syntax before anything a schema could decide. It assumes a
character boundary; mid-character (after a lead byte) or after a backslash a lazy row carries
no ban and allows everything (lazy_masks.lazy_row_ban)."""
from __future__ import annotations

_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_AFTER_STRING = frozenset(b",:}]")  # what JSON lets follow a string, after whitespace
_WHITESPACE = frozenset(b" \t\n\r")


def breaks_json_string(data: bytes | None, raw_controls: bytes = b"") -> bool:
    """Whether no JSON text can continue with these bytes from a character boundary inside a
    string. Tokens without bytes (special tokens) never can. raw_controls: control bytes
    taken as string characters all the same (where the JSON ban lets whitespace tokens
    through, xgrammar's length-bounded strings admit them raw)."""
    if not data:
        return True
    expect = 0  # UTF-8 continuation bytes still due
    hex_left = 0  # hex digits of a \\u escape still due
    escaped = closed = False
    for byte in data:
        if closed:  # after the closing quote
            if byte in _AFTER_STRING:
                return False  # past the string: the schema decides, not JSON's string syntax
            if byte not in _WHITESPACE:
                return True
        elif expect:
            if not 0x80 <= byte < 0xC0:
                return True
            expect -= 1
        elif hex_left:
            if byte not in _HEX:
                return True
            hex_left -= 1
        elif escaped:
            if byte == 0x75:  # u
                hex_left = 4
            elif byte not in _ESCAPES:
                return True
            escaped = False
        elif byte == 0x22:  # "
            closed = True
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte < 0x20:
            if byte not in raw_controls:
                return True
        elif 0x80 <= byte < 0xC2 or byte >= 0xF5:  # not UTF-8 here
            return True
        elif byte >= 0xC0:
            expect = 1 if byte < 0xE0 else 2 if byte < 0xF0 else 3
    return False


def json_string_banned(token_bytes: list[bytes | None],
                       raw_controls: bytes = b"") -> frozenset[int]:
    """The ids of the tokens breaks_json_string rules out."""
    return frozenset(i for i, data in enumerate(token_bytes)
                     if breaks_json_string(data, raw_controls))


def utf8_pending(pending: int, data: bytes) -> int:
    """UTF-8 continuation bytes still due after `data`, `pending` being due before it."""
    if data.isascii():
        return 0
    for byte in data:
        if pending and 0x80 <= byte < 0xC0:
            pending -= 1
        elif byte >= 0xF0:
            pending = 3
        elif byte >= 0xE0:
            pending = 2
        elif byte >= 0xC0:
            pending = 1
        else:
            pending = 0
    return pending
