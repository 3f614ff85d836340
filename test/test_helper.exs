# :nx_doctest is excluded until Moat.Backend implements every callback
# (run it with --include nx_doctest).
ExUnit.start(exclude: [:soak, :nx_doctest])
