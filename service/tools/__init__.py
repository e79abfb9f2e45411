"""Offline tools: the commands that write, repair or measure heads on disk.

Import a Hugging Face checkpoint (``importer``, reading it with ``checkpoints``), the demo
heads (``demo``) and small checkpoints to import (``demo_checkpoints``), repair a duplicated
tied weight (``retie``), trim a vocabulary (``trim``), and measure what a head costs a process
(``memory``). They run outside any service.

May import: ``service.plane``, ``service.repository``, ``service.runtime``, ``service.heads``
and the shared basics at the package root. Never ``service.api``, ``service.hosting`` or
``service.cli`` (``make layers`` checks the order).
"""
