"""Five JSON schemas, one per feature a structured output must honour: nested objects, arrays
with min/max items, enums, numbers with bounds, optional fields. The structured-outputs tests
(tests/test_structured_outputs*.py) and benchmark (benchmarks/bench_structured.py) run them,
and `python examples/json_schemas.py` shows the default model filling each.

Strings carry a maxLength: the default model is tiny and trained on Python source, and at
temperature 1.0 an unbounded string lets it ramble until max_tokens cuts the object short.
"""

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 10},
                                    "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
                     "required": ["name", "id"]},
            "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["user", "meta"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "minItems": 2, "maxItems": 4},
            "names": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        },
        "required": ["items", "names"],
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "level": {"enum": [1, 2, 3]}},
        "required": ["color", "size", "level"],
    },
    "bounds": {
        "type": "object",
        "properties": {"temp": {"type": "number", "minimum": -40, "maximum": 50},
                       "count": {"type": "integer", "minimum": 1, "maximum": 10},
                       "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["temp", "count", "ratio"],
    },
    "optional": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 12},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "note": {"type": "string", "maxLength": 8},
                       "draft": {"type": "boolean"}},
        "required": ["title"],
    },
}


def main() -> None:
    from hybrid_engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    for name, schema in SCHEMAS.items():
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=300,
                                structured_outputs=StructuredOutputsParams(json=schema))
        out = llm.generate(["# a record\n"], params, use_tqdm=False)[0].outputs[0]
        print(f"{name}: {out.text}")


if __name__ == "__main__":
    main()
