"""End to end: the structured-output frameworks clients use, unchanged, against the real server
and model: instructor (JSON_SCHEMA and TOOLS modes) and langchain-openai's
with_structured_output (json_schema and function_calling); both are test dependencies, so these
tests run wherever the suite does."""
from __future__ import annotations

from typing import Literal

import instructor
import langchain_openai
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "default"
PROMPT = "Describe a fictional person as JSON: a name, an age and a role."


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


def check(person) -> None:
    assert isinstance(person, Person)
    Person.model_validate(person.model_dump())  # every bound held, not just parsed


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(server_url, mode):
    client = instructor.from_openai(
        openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=300),
        mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": PROMPT}])
    check(person)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server_url, method):
    llm = langchain_openai.ChatOpenAI(base_url=server_url + "/v1", api_key="unused", model=MODEL,
                                      temperature=0, max_tokens=80, max_retries=0, timeout=300)
    person = llm.with_structured_output(Person, method=method).invoke(PROMPT)
    check(person)
