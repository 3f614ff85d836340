defmodule Moat.FinalizerFallbackTest do
  # Moat without the finalizer NIF (MOAT_FINALIZER=off), in a second VM:
  # explicit release and scopes still free tensors, nothing else does.
  use ExUnit.Case, async: false

  @script ~S"""
  {:ok, _} = Application.ensure_all_started(:moat)
  f32 = fn v -> <<v::float-32-native>> end
  t = Moat.from_binary(f32.(1.0), {1}, {:f, 32})
  explicit = {Moat.deallocate(t), Moat.deallocate(t)}
  Moat.scope(fn -> Moat.from_binary(f32.(2.0), {1}, {:f, 32}) && :done end)
  after_scope = Moat.memory_info().tensors
  parent = self()
  spawn(fn -> Moat.from_binary(f32.(3.0), {1}, {:f, 32}); send(parent, :made) end)
  receive do: (:made -> :ok)
  :erlang.garbage_collect()
  after_exit = Moat.memory_info().tensors
  kept = Moat.scope(fn -> Moat.from_binary(f32.(4.0), {1}, {:f, 32}) end)
  %{
    loaded: Moat.Finalizer.loaded?(),
    error: Moat.Finalizer.load_error(),
    explicit: explicit,
    after_scope: after_scope,
    after_exit: after_exit,
    kept: Moat.to_binary(kept) == f32.(4.0)
  }
  """

  test "explicit release and scopes work; dropped handles stay" do
    paths = Enum.flat_map(:code.get_path(), &[~c"-pa", &1])

    {:ok, peer, _} =
      :peer.start_link(%{connection: :standard_io, args: paths, env: [{~c"MOAT_FINALIZER", ~c"off"}]})

    {result, _} = :peer.call(peer, Code, :eval_string, [@script], 30_000)
    :peer.stop(peer)

    assert %{loaded: false, error: {:disabled, _}, explicit: {:ok, :already_deallocated}} = result
    assert result.after_scope == 0
    assert result.after_exit == 1, "without the NIF, the exited process's tensor stays"
    assert result.kept
  end
end
