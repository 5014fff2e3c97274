"""Entry points: thin command-line shells over the layers below (``paritylab``, ``paritylab-compare``,
``paritylab-promote``, ``paritylab-upload``, ``paritylab-bisect``)."""
