"""The application apart from the library: the ``qtransform`` command (:mod:`.cli`), offline models
and corpora, evaluation (perplexity, generation), reports and checkpoint descriptions."""
