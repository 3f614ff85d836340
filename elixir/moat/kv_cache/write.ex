defmodule Moat.KVCache.Write do
  @moduledoc false
  # The Nx.block/4 of Moat.KVCache.write/4 (its own module: Moat.Backend
  # matches it, and Moat.KVCache uses Moat.Backend).
  defstruct axis: 2
end
