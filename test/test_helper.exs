# :nx_doctest is excluded until Moat.Backend implements every callback
# (run it with --include nx_doctest).
# :large (a 2 GiB round trip) needs about 8 GiB free; skipped where there is less.
large = if Moat.Reliability.mem_available() > 10 * 1024 ** 3, do: [], else: [:large]
ExUnit.start(exclude: [:soak, :nx_doctest] ++ large)
