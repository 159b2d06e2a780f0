"""Text shipped with the package: the corpus used to train the tokenizers of built-in
random-weight checkpoints."""
