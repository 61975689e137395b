"""bench_grammar_engines.py's parts: the grammars and documents, the two engines behind one interface, the
measurements, and the report."""
