"""Structured outputs: what constrains a completion, kept apart from the engine that applies
it. A choice is a trie of token ids (choice.py); a regex, JSON schema or grammar is an
llguidance grammar, checked when the params are made and matched per completion into a
packed bitmask (grammar.py); either may start after the reasoning (after_reasoning.py)."""
