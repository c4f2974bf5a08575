"""Structured outputs: a constraint's grammar work (`manager.StructuredOutputManager`), isolated first compiles (`grammar_worker`)."""
