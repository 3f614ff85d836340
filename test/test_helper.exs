# :soak (long variants) runs with bin/soak; :hex_tarball (builds the worker
# from the Hex package, minutes) with `mix test --only hex_tarball`. :large
# (a 2 GiB round trip) needs about 8 GiB free; it is skipped where there is
# less.
large = if Moat.Reliability.mem_available() > 10 * 1024 ** 3, do: [], else: [:large]
ExUnit.start(exclude: [:soak, :hex_tarball] ++ large)
