"""Record and replay: deterministic agent runs, with secrets never written down.

Modules, in the order a call meets them:

=================  ==========================================================================
``redact.py``      the one redaction: provenance (injected credentials), names, token shapes,
                   URL credentials; through JSON escapes
``codings.py``     content codings: coded bodies decoded for redaction and lint
``lint.py``        ``lint(dir)``: what is left that looks secret, and where
``canonical.py``   the canonical call key: target, canonical body (JSON, SQL), volatile fields
``format.py``      the versioned directory format: version, file layout, run file names, time
                   stamps, ``RecordingError``
``model.py``       the typed records: ``Exchange`` (a call as recorded) and ``Entry``,
                   ``RecordedRun``, ``Recording`` (as read back)
``blobs.py``       ``BlobStore``: content-addressed bodies; inline body encoding
``writer.py``      ``RecordingWriter``: the one writer (redacts, stores blobs, appends lines)
``reader.py``      ``load_recording``: the validating reader (manifest, run files, records)
``verify.py``      the manifest's counts against the records; ``repair`` after a crash
``compat.py``      step-by-step migrations of older versions
``matching.py``    per-run replay state, nearest-recording explanations, end-of-run report
``denial.py``      ``Denial``, ``denial_of(call)`` and ``DenialRecorder``: refused calls, as
                   recorders observe them
``har.py``         HAR 1.2 export and import
``placeholders.py``  credentials for replay in CI, where the real secrets do not exist
=================  ==========================================================================

``recordings/example/`` is regenerated from the mocks by ``python -m mocks.make_example``, which
lives with the mocks, outside the shipped package.

The transports live with the others: ``gateway/transports/record.py`` (``record``) and
``gateway/transports/replay.py`` (``replay``, ``replay-or-record``, ``shadow``);
``gateway/transports/modes.py`` is the one place a mode becomes a transport. The commands
that use recordings (``capgate recording ...``, ``policy test``, ``replay``) are in
``gateway/commands/``.
"""
