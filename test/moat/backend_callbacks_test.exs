defmodule Moat.BackendCallbacksTest do
  use ExUnit.Case, async: true

  test "Moat.Backend implements every Nx.Backend callback" do
    Code.ensure_loaded!(Moat.Backend)
    callbacks = Nx.Backend.behaviour_info(:callbacks)
    missing = Enum.reject(callbacks, fn {f, a} -> function_exported?(Moat.Backend, f, a) end)
    assert length(callbacks) >= 115
    assert missing == []
  end
end
