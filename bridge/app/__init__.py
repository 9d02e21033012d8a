"""The application apart from the library: the ``qtransform`` command (:mod:`.cli` parses and
dispatches; :mod:`.quantize` and :mod:`.export` run their subcommands), offline models and
corpora, evaluation (perplexity, generation), reports and checkpoint descriptions."""
