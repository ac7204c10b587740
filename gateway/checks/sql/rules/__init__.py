"""The rule families a statement is checked against, one module each, run by ``driver``.

Each takes the ``Statement`` under check (``statement``): the ``SqlRules`` it is held to, its
text and tree, and the sets it records what it found in. No rule imports the driver or the
policy.

``statements``  what the statement is and what it contains: kinds, commands, INTO, locks,
                variables
``functions``   the allow-list of functions, by the name the database resolves
``tables``      the tables named, read through SQL's scoping of CTEs; system catalogs
``columns``     denied columns, however they are reached
``limit``       the LIMIT of the outermost query
"""
