defmodule Moat.BackendConversionTest do
  # Creation, transfer between backends and workers, inspection, pointers.
  use ExUnit.Case, async: false
  import Moat.Case

  test "tensors travel to and from Nx.BinaryBackend" do
    t = Nx.tensor([[1, 2], [3, 4]], type: :s16, backend: Nx.BinaryBackend)
    moat = Nx.backend_transfer(t, Moat.Backend)
    assert %Moat.Backend{} = moat.data
    back = Nx.backend_transfer(moat, Nx.BinaryBackend)
    assert %Nx.BinaryBackend{} = back.data
    assert back == t
    # The transfer released the Moat tensor.
    assert_raise Moat.Error, ~r/was deallocated/, fn -> Nx.to_binary(moat) end
  end

  test "backend_copy within a worker keeps both tensors alive" do
    a = Nx.tensor([1.0, 2.0], backend: Moat.Backend)
    b = Nx.backend_copy(a, Moat.Backend)
    assert a.data.ref.id != b.data.ref.id
    Nx.backend_deallocate(a)
    assert Nx.to_flat_list(b) == [1.0, 2.0]
  end

  test "tensors move between workers" do
    other = start_worker(:moat_conversion_other)
    a = Nx.tensor([1, 2, 3], type: :u8, backend: Moat.Backend)
    b = Nx.backend_transfer(a, {Moat.Backend, worker: other})
    assert b.data.ref.worker == other
    assert Nx.to_flat_list(Nx.add(b, 1)) == [2, 3, 4]
    assert Nx.backend_transfer(b, {Moat.Backend, worker: other}) == b
  end

  test "constants, iota and eye are created in the worker the options name" do
    other = start_worker(:moat_conversion_creation)
    backend = {Moat.Backend, worker: other}
    assert Nx.iota({2, 3}, axis: 1, backend: backend).data.ref.worker == other
    assert Nx.to_flat_list(Nx.iota({2, 3}, axis: 1, backend: backend)) == [0, 1, 2, 0, 1, 2]
    assert Nx.to_flat_list(Nx.eye(2, type: :u8, backend: backend)) == [1, 0, 0, 1]
    assert Nx.to_flat_list(Nx.broadcast(Nx.tensor(:nan, backend: backend), {2})) == [:nan, :nan]
    assert Nx.to_flat_list(Nx.Constants.max_finite({:u, 64}, backend: backend)) == [Integer.pow(2, 64) - 1]
  end

  test "inspect names the backend and device, and reads only what it shows" do
    t = Nx.iota({1000}, backend: Moat.Backend)
    text = inspect(t, limit: 3)
    assert text =~ "Moat.Backend(#{Moat.Worker.info().device})"
    assert text =~ "[0, 1, 2, ...]"
    assert Nx.to_binary(t, limit: 2) == <<0::32-native, 1::32-native>>
  end

  test "pointers raise and say why" do
    t = Nx.tensor([1, 2], backend: Moat.Backend)
    assert_raise ArgumentError, ~r/another OS process/, fn -> Nx.to_pointer(t, mode: :local) end
    assert_raise ArgumentError, ~r/IPC handles/, fn -> Nx.to_pointer(t, mode: :ipc) end

    pointer = %Nx.Pointer{kind: :local, address: 0, data_size: 8}
    assert_raise ArgumentError, ~r/from_pointer/, fn -> Nx.from_pointer(Moat.Backend, pointer, :s32, {2}) end
  end

  test "slice accepts tensor start indices" do
    t = Nx.iota({5}, backend: Moat.Backend)
    assert Nx.to_flat_list(Nx.slice(t, [Nx.tensor(3)], [2])) == [3, 4]
    # Clamped so that the window fits, as in Nx.
    assert Nx.to_flat_list(Nx.slice(t, [4], [2])) == [3, 4]
  end

  test "the device is checked against the worker's devices and carried per tensor" do
    device = Moat.Worker.info().device
    t = Nx.tensor([1.0, 2.0], backend: {Moat.Backend, device: device})
    assert %Moat.Backend{device: ^device} = t.data
    assert %Moat.Backend{device: ^device} = Nx.add(t, t).data
    assert %Moat.Backend{device: ^device} = Nx.tensor([1.0], backend: Moat.Backend).data

    unless :gpu in Moat.Worker.info().devices do
      assert_raise ArgumentError, ~r/device :gpu is not available on worker Moat.Worker/, fn ->
        Nx.tensor([1.0], backend: {Moat.Backend, device: :gpu})
      end

      assert_raise ArgumentError, ~r/device :gpu is not available/, fn ->
        Nx.iota({3}, backend: {Moat.Backend, device: :gpu})
      end
    end

    assert_raise ArgumentError, ~r/device :tpu is not available/, fn ->
      Nx.tensor([1.0], backend: {Moat.Backend, device: :tpu})
    end
  end
end
