defmodule Moat.ProtocolDocTest do
  # protocol.md's examples, checked against the Elixir codec: each term
  # encodes to exactly the bytes shown, and the bytes decode to the term.
  use ExUnit.Case, async: true

  @doc_path Path.expand("../../protocol.md", __DIR__)
  @external_resource @doc_path

  examples =
    @doc_path
    |> File.read!()
    |> String.split("## 7. Examples")
    |> List.last()
    |> String.split("### Example: ")
    |> tl()
    |> Enum.map(fn part ->
      [title | _] = String.split(part, "\n", parts: 2)
      [_, term] = Regex.run(~r/```term\n(.*?)```/s, part)
      [_, hex] = Regex.run(~r/```hex\n(.*?)```/s, part)
      {title, String.trim(term), String.replace(hex, ~r/\s/, "")}
    end)

  doc = File.read!(@doc_path)
  [_, batch_terms] = Regex.run(~r/```batch\n(.*?)```/s, doc)
  [_, batch_hex] = Regex.run(~r/```batch-hex\n(.*?)```/s, doc)
  @batch_terms batch_terms |> String.split("\n", trim: true) |> Enum.map(&elem(Code.eval_string(&1), 0))
  @batch_hex String.replace(batch_hex, ~r/\s/, "")

  [_, malformed] = Regex.run(~r/```batch-malformed\n(.*?)```/s, doc)
  [_, malformed_hex] = Regex.run(~r/```batch-malformed-hex\n(.*?)```/s, doc)
  @malformed String.split(malformed, "\n", trim: true)
  @malformed_hex String.replace(malformed_hex, ~r/\s/, "")

  test "§1's malformed batch example: a batch packet whose frames are what Moat.Protocol.request/6 writes" do
    <<len::32, body::binary-size(len)>> = Base.decode16!(@malformed_hex, case: :lower)
    assert <<0::32, _::binary>> = body

    {terms, refusals} = Enum.split_with(@malformed, &String.starts_with?(&1, "{"))
    assert length(terms) == 1 and length(refusals) == 2
    assert Enum.all?(refusals, &String.starts_with?(&1, "refused: malformed batch: "))

    for line <- terms do
      {{seq, g, op, outs, ins, attrs}, _} = Code.eval_string(line)
      frame = IO.iodata_to_binary(Moat.Protocol.request(seq, g, op, outs, ins, attrs))
      assert :binary.match(body, <<byte_size(frame)::32, frame::binary>>) != :nomatch, line
    end
  end

  test "§1's batch example is what Moat.Protocol.batch/1 writes" do
    frames = for {seq, g, op, outs, ins, attrs} <- @batch_terms, do: Moat.Protocol.request(seq, g, op, outs, ins, attrs)
    assert length(frames) == 2
    body = IO.iodata_to_binary(Moat.Protocol.batch(frames))
    assert Base.encode16(<<byte_size(body)::32, body::binary>>, case: :lower) == @batch_hex
  end

  test "the document has examples" do
    assert length(unquote(Macro.escape(examples))) >= 10
  end

  for {title, term_text, hex} <- examples do
    test "example: #{title}" do
      {term, _} = Code.eval_string(unquote(term_text))
      bytes = Base.decode16!(unquote(hex), case: :lower)
      assert Moat.Protocol.encode_header(term) == bytes
      assert {:ok, ^term, ""} = Moat.Protocol.decode(<<byte_size(bytes)::32, bytes::binary>>)
    end
  end

  test "request frames are header length, header, payload" do
    frame = Moat.Protocol.request(0, 3, :from_binary, [5], [], %{bytes: 4}, ["ab", "cd"])
    binary = IO.iodata_to_binary(frame)
    assert {:ok, {0, 3, :from_binary, [5], [], %{bytes: 4}}, "abcd"} = Moat.Protocol.decode(binary)
  end

  test "undecodable headers are errors, not crashes" do
    assert {:error, _} = Moat.Protocol.decode(<<3::32, 1, 2, 3>>)
    assert {:error, _} = Moat.Protocol.decode(<<9::32, 1>>)
  end

  test "the seq of a reply that cannot be decoded safely can still be read" do
    # {:ok, 300, :an_atom_this_vm_has_never_seen_xyzzy}, encoded by hand.
    atom = "an_atom_this_vm_has_never_seen_xyzzy"
    header = <<131, 104, 3, 119, 2, "ok", 98, 300::32, 119, byte_size(atom), atom::binary>>
    frame = <<byte_size(header)::32, header::binary>>
    assert {:error, _} = Moat.Protocol.decode(frame)
    assert Moat.Protocol.peek_seq(frame) == {:ok, 300}

    big = :erlang.term_to_binary({:ok, 2 ** 40, nil}, minor_version: 2)
    assert Moat.Protocol.peek_seq(<<byte_size(big)::32, big::binary>>) == {:ok, 2 ** 40}
    assert Moat.Protocol.peek_seq(<<3::32, 1, 2, 3>>) == :error
  end
end
