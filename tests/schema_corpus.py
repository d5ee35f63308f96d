"""Real-world JSON schemas for structured-output tests: the shapes RAG and agent code asks
for (nested objects, bounded arrays, enums, anyOf / oneOf, optional fields, string formats
and patterns, bounded numbers). Every string and array is bounded so that a completion
fits a test's max_tokens; the grammar, not the model, guarantees the shape. (xgrammar
ignores maxLength on a string with a format, so formats here are fixed-length ones.)"""

RAG_ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 120},
        "cited_chunk_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                            "minItems": 1, "maxItems": 3},
    },
    "required": ["answer", "cited_chunk_ids"],
    "additionalProperties": False,
}

SCHEMAS = {
    "rag_answer": RAG_ANSWER,
    "grade_document": {
        "title": "GradeDocuments", "type": "object",
        "properties": {"binary_score": {"type": "string", "enum": ["yes", "no"],
                                        "description": "Documents are relevant to the question"}},
        "required": ["binary_score"],
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "born": {"type": "string", "format": "date"},
            "nickname": {"type": "string", "maxLength": 20},
        },
        "required": ["name", "age"],
    },
    "address_book": {
        "type": "object",
        "properties": {"contacts": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 30},
                           "address": {"type": "object",
                                       "properties": {"city": {"type": "string", "maxLength": 30},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                       "required": ["city", "zip"]}},
            "required": ["name", "address"]}}},
        "required": ["contacts"],
    },
    "event": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "date": {"type": "string", "format": "date"},
                       "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                       "attendees": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["title", "date", "priority"],
    },
    "search_query": {
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 3, "maxLength": 60},
                       "top_k": {"type": "integer", "minimum": 1, "maximum": 20},
                       "filters": {"type": "array", "maxItems": 3,
                                   "items": {"type": "string", "enum": ["docs", "code", "issues"]}}},
        "required": ["query", "top_k"],
    },
    "measurement": {
        "type": "object",
        "properties": {"value": {"type": "number", "minimum": -100, "maximum": 100},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["value", "unit"],
    },
    "shape_any_of": {
        "type": "object",
        "properties": {"shape": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["kind", "radius"]},
            {"type": "object", "properties": {"kind": {"const": "square"},
                                              "side": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["kind", "side"]}]}},
        "required": ["shape"],
    },
    "payment_one_of": {
        "type": "object",
        "properties": {"method": {"oneOf": [{"type": "string", "enum": ["cash", "card"]},
                                            {"type": "integer", "minimum": 1000, "maximum": 9999}]},
                       "paid": {"type": "boolean"}},
        "required": ["method", "paid"],
    },
    "nullable_fields": {
        "type": "object",
        "properties": {"summary": {"type": "string", "maxLength": 80},
                       "confidence": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]}},
        "required": ["summary", "confidence"],
    },
    "with_refs": {
        "type": "object",
        "$defs": {"Chunk": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                              "score": {"type": "number", "minimum": 0, "maximum": 1}},
                            "required": ["id", "score"]}},
        "properties": {"chunks": {"type": "array", "items": {"$ref": "#/$defs/Chunk"}, "minItems": 1, "maxItems": 2}},
        "required": ["chunks"],
    },
    "uuid_and_pattern": {
        "type": "object",
        "properties": {"request_id": {"type": "string", "format": "uuid"},
                       "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
        "required": ["request_id", "sku"],
    },
}
