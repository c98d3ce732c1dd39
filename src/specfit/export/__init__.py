"""``specfit export``: a model folder that stock transformers runs with SpecFit, with no SpecFit code in the user's
program. transformers' own hook for a decoding strategy shipped with a model is ``custom_generate``: a folder (or a
Hub repo) carrying ``custom_generate/generate.py`` whose ``generate`` replaces the model's when it is loaded with
``trust_remote_code=True``; without it the model is plain.

The rooms: ``settings`` (the small JSON file of SpecFit settings the folder carries), ``writer`` (the folder: weights
linked or copied, the drafter, the tokenizer, the template), ``card`` (its README for the Hub), ``command`` (the CLI),
``location`` (where a loaded model's folder is), ``runtime`` (the ``generate`` the template calls: SpecFit enabled
lazily on the model the stock loader placed), ``streamer`` (a multi-token put given to a streamer one token per
entry); the template itself is ``custom_generate/generate.py``. docs/export.md says how to use it.
"""
