"""Benchmark workloads shared by serve.py and baseline_hf.py: chat, JSON-schema, tool-call and
shared-prefix requests as OpenAI chat bodies, sampled from ../shared/data, saved to / read from
JSONL so that a machine without the data can run them.

A `WorkItem` holds a request body without the per-run fields (model, max_tokens, stream,
temperature); `body` carries the constraint itself (response_format or tools), so validity checks
need nothing else.
"""
from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import jsonschema

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
WORKLOADS = ("chat", "json", "tools", "shared-prefix", "mixed")
# real-world subsets of JSONSchemaBench (the BFCL_* ones are covered by the tools workload);
# Kubernetes schemas are left out by default: they are mostly huge and compile slowly
JSON_SUBSETS = ("Glaiveai2K", "Github_easy", "Github_medium", "Snowplow", "JME")
TOOL_CATEGORIES = ("simple_python", "multiple", "parallel")
MAX_SCHEMA_CHARS = 3000  # schemas longer than this (as JSON text) are not sampled

CHAT_QUESTIONS = (
    "Explain how a hash map works and when you would not use one.",
    "Write a short poem about the sea at night.",
    "What are the main causes of inflation?",
    "Give me three tips for learning a new language as an adult.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How does photosynthesis turn light into chemical energy?",
    "What is the difference between TCP and UDP?",
    "Suggest a vegetarian dinner I can cook in thirty minutes.",
    "Why is the sky blue?",
    "Describe the water cycle to a ten-year-old.",
    "What should I consider when buying a used car?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the idea behind gradient descent.",
    "What were the main consequences of the printing press?",
    "How do vaccines train the immune system?",
    "Compare renting and buying a home.",
    "Write a friendly email declining a meeting invitation.",
    "What is a black hole and how does one form?",
    "Give a short history of the bicycle.",
    "How can I improve my sleep?",
    "Explain recursion with a simple example.",
    "What are the pros and cons of remote work?",
    "Describe how a bill becomes a law in a parliamentary system.",
    "What is the Pythagorean theorem and why does it hold?",
    "Plan a three-day trip to a city famous for its museums.",
    "How do noise-cancelling headphones work?",
    "Explain the difference between weather and climate.",
    "Write a haiku about autumn leaves.",
    "What makes a good software code review?",
    "How does compound interest work?",
    "Why do cats purr?",
    "Explain what a database index is and what it costs.",
)

_TOPICS = ("billing", "refunds", "shipping", "returns", "account security", "password resets",
           "privacy", "data export", "subscriptions", "discounts", "gift cards", "warranties",
           "repairs", "installation", "compatibility", "accessibility", "business accounts",
           "invoices", "taxes", "international orders", "damaged items", "missing parcels",
           "loyalty points", "product recalls", "complaints", "feedback", "escalations",
           "outages", "maintenance windows", "legal requests")


@dataclass(slots=True)
class WorkItem:
    id: str
    kind: str  # chat | json | tools | shared-prefix
    body: dict  # an OpenAI chat-completions body without model / max_tokens / stream


def shared_system_prompt() -> str:
    """A fixed ~1k-token (SmolLM2 tokenizer) customer-support handbook, the same for every run."""
    lines = ["You are the support assistant of Northwind Appliances. Follow this handbook.", ""]
    for i, topic in enumerate(_TOPICS[:21], 1):
        lines.append(f"Rule {i} ({topic}): when a customer asks about {topic}, first confirm "
                     f"their order number, then explain our {topic} policy in plain words, "
                     f"and offer a follow-up by email if the question is not resolved.")
    lines.append("Always be polite, brief and accurate. Never invent order details.")
    return "\n".join(lines)


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _sample(pool: list, num: int, rng: random.Random) -> list:
    """`num` items from `pool`: a random sample, repeated in shuffled rounds if num > len(pool)."""
    if not pool:
        raise ValueError("empty pool: no data matched the workload's filters")
    out: list = []
    while len(out) < num:
        out.extend(rng.sample(pool, min(len(pool), num - len(out))))
    return out


def chat_items(num: int, rng: random.Random) -> list[WorkItem]:
    questions = _sample(list(CHAT_QUESTIONS), num, rng)
    return [WorkItem(f"chat-{i}", "chat", {"messages": [{"role": "user", "content": q}]})
            for i, q in enumerate(questions)]


def shared_prefix_items(num: int, rng: random.Random) -> list[WorkItem]:
    system = shared_system_prompt()
    questions = _sample(list(CHAT_QUESTIONS), num, rng)
    return [WorkItem(f"prefix-{i}", "shared-prefix", {"messages": [
        {"role": "system", "content": system},
        # the index keeps every prompt distinct past the shared system prompt
        {"role": "user", "content": f"(ticket {i}) {q}"}]}) for i, q in enumerate(questions)]


def _usable_schema(schema) -> bool:
    if not isinstance(schema, dict) or len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        return False
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator
                                            ).check_schema(schema)
    except Exception:  # noqa: BLE001 - a schema the validator cannot use cannot be checked
        return False
    return True


def json_items(num: int, rng: random.Random, data: Path,
               subsets: tuple[str, ...] = JSON_SUBSETS) -> list[WorkItem]:
    pool = [r for s in subsets for r in _read_jsonl(data / "jsonschemabench" / f"{s}.jsonl")]
    rng.shuffle(pool)
    # checked lazily: check_schema over every schema of the pool takes tens of seconds
    usable = (r for r in pool if _usable_schema(r["schema"]))
    picked = [r for r, _ in zip(usable, range(num))]
    items = []
    for i, r in enumerate(_sample(picked, num, rng)):
        schema = r["schema"]
        prompt = ("Produce one realistic JSON instance of the following JSON schema. "
                  "Answer with the JSON only.\n\n" + json.dumps(schema))
        items.append(WorkItem(f"json-{i}-{r['id']}", "json", {
            "messages": [{"role": "user", "content": prompt}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema, "strict": True}}}))
    return items


def tool_items(num: int, rng: random.Random, data: Path,
               categories: tuple[str, ...] = TOOL_CATEGORIES) -> list[WorkItem]:
    pool = [r for c in categories for r in _read_jsonl(data / "bfcl" / f"{c}.jsonl")]
    return [WorkItem(f"tools-{i}-{r['id']}", "tools", {
        "messages": r["messages"], "tools": r["tools"], "tool_choice": "required"})
        for i, r in enumerate(_sample(pool, num, rng))]


def build(workload: str, num: int, *, seed: int = 0, data: Path = DEFAULT_DATA) -> list[WorkItem]:
    """`num` requests of `workload` (one of WORKLOADS), or read back from a .jsonl file path."""
    path = Path(workload)
    if workload not in WORKLOADS and path.suffix == ".jsonl":
        items = load(path)
        return [items[i % len(items)] for i in range(num)] if num else items
    rng = random.Random(seed)
    if workload == "chat":
        return chat_items(num, rng)
    if workload == "shared-prefix":
        return shared_prefix_items(num, rng)
    if workload == "json":
        return json_items(num, rng, data)
    if workload == "tools":
        return tool_items(num, rng, data)
    if workload == "mixed":  # a third each of chat, json and tools, interleaved
        parts = [chat_items(num // 3 + 1, rng), json_items(num // 3 + 1, rng, data),
                 tool_items(num // 3 + 1, rng, data)]
        return [parts[i % 3][i // 3] for i in range(num)]
    raise ValueError(f"unknown workload {workload!r}: one of {WORKLOADS} or a .jsonl file")


def save(items: list[WorkItem], path: Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(asdict(item)) + "\n" for item in items)


def load(path: Path) -> list[WorkItem]:
    return [WorkItem(r["id"], r["kind"], r["body"]) for r in _read_jsonl(Path(path))]


# ---- validity ---------------------------------------------------------------------------------

def schema_errors(instance, schema) -> str | None:
    """None if `instance` validates against `schema` (formats checked), else the first error."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    with warnings.catch_warnings():  # the "regex" format compiles user patterns noisily
        warnings.simplefilter("ignore")
        error = jsonschema.exceptions.best_match(
            cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance))
    return None if error is None else error.message[:200]


def check_json(item: WorkItem, text: str) -> str | None:
    """None if `text` is a JSON instance of the item's response_format schema, else why not."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    return schema_errors(value, item.body["response_format"]["json_schema"]["schema"])


def check_tool_calls(item: WorkItem, calls: list[tuple[str, str]]) -> str | None:
    """None if there is at least one call and every (name, arguments) pair names one of the
    item's tools with arguments valid against its parameters schema, else why not."""
    if not calls:
        return "no tool call"
    params = {t["function"]["name"]: t["function"].get("parameters") or {}
              for t in item.body["tools"]}
    for name, arguments in calls:
        if name not in params:
            return f"unknown tool {name!r}"
        try:
            args = json.loads(arguments)
        except ValueError as e:
            return f"arguments of {name} not JSON: {e}"
        error = schema_errors(args, params[name])
        if error:
            return f"{name}: {error}"
    return None


def is_constrained(item: WorkItem) -> bool:
    return item.kind in ("json", "tools")


def check(item: WorkItem, text: str, calls: list[tuple[str, str]]) -> str | None:
    """None if the answer of a constrained item is valid, else why not (see is_constrained)."""
    if item.kind == "json":
        return check_json(item, text)
    return check_tool_calls(item, calls)


# ---- tables -----------------------------------------------------------------------------------

def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """One markdown table: columns are (row key, title, format); None and NaN print as -."""
    def cell(row, key, fmt):
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return fmt.format(value)

    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)
