"""Structured outputs: what constrains a completion, kept apart from the engine that applies
it. A choice is a trie of token ids (choice.py); a regex is parsed and its size checked
(regex_syntax.py), built as an NFA with counters and a lazy DFA (regex_automaton.py), and
walked over the vocabulary's bytes for the tokens each state allows (regex_guide.py); a JSON
schema becomes a regex (json_schema.py)."""
